"""ft's step loop against a bare loop in one process, on one DeepSpeed engine, in alternating blocks.

benchmarks/training.py compares whole runs, a bare process against an ft worker process: the
end-to-end figure. But two processes of identical code land far apart on a shared machine (its
--control: x0.75 .. x2.03 for bare against bare on this machine's host-bound steps), so a few
percent of ft cost cannot be told from which process got the better memory and cores. This takes
the process out: one engine, one model in memory, one set of examples; rounds of three blocks of
--block steps (bare, ft, bare again; the order rotated each round), each block timed between two
synchronisations. ft's block is toolkit.train.loop.Loop.run itself: its batches, per-step seeding,
loss window, agreement, metrics lines and progress reports, with checkpoints off (their cost is
benchmarks/checkpoint.py's). The median of the rounds' ft/bare ratios is what ft's loop costs; the
median of bare-again/bare is how far identical blocks land apart here: the floor of the figure.

Each ft block starts as a run does: its first step's loss is read at once (one synchronisation a
block more than a run has once per start), so ft is charged a little more than it costs a run.

    python benchmarks/loop_overhead.py [--rounds 10] [--block 30] [--hidden 64] [--layers 2]
    python benchmarks/loop_overhead.py --device cuda --hidden 2048 --layers 8    # one GPU, bf16, NCCL
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training import REPO, build_model, environment, spec_for

BLOCKS = r"""
import json, os, sys, time
from pathlib import Path
import deepspeed, torch
import torch.distributed as dist
from transformers import AutoTokenizer
from toolkit.recipe.run_spec import RunSpec, batch_plan
from toolkit.runs.layout import RunLayout
from toolkit.train.data import batch_indices, collate, rank_slice
from toolkit.train.dataset import load_examples
from toolkit.train.engine import deepspeed_config
from toolkit.train.faults import Faults
from toolkit.train.loop import Loop
from toolkit.train.models import trainable_model
from toolkit.train.objectives import objective_for
from toolkit.train.tracking import Tracker
from toolkit.watch.progress import Reporter

spec = RunSpec.model_validate_json(Path(sys.argv[1]).read_text())
recipe, order, block, warmup = spec.recipe, json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
backend = os.environ["FT_DIST_BACKEND"]
cuda = backend == "nccl"
if cuda:
    torch.cuda.set_device(0)
deepspeed.init_distributed(dist_backend=backend)
torch.manual_seed(recipe.training.seed)
quiet = lambda message: None
model_path = Path(recipe.model.base)
layout = RunLayout(Path(os.environ["FT_RUN_DIR"]))
tokenizer = AutoTokenizer.from_pretrained(model_path)
objective = objective_for(recipe.objective)
units = objective.units(load_examples(recipe, model_path, Path(sys.argv[5]), 0, dist, quiet))
plan = batch_plan(recipe.training, 1)
model = trainable_model(model_path, recipe.method, recipe.training)
total = warmup + block * len(order)
engine, *_ = deepspeed.initialize(model=model, config=deepspeed_config(recipe.training, plan, total),
                                  model_parameters=[p for p in model.parameters() if p.requires_grad])


class NoCheckpoints:  # their cost is measured on its own (benchmarks/checkpoint.py)
    seconds = 0.0

    def due_by_steps(self, step): return False
    def due_by_clock(self): return False
    def before_optimizer_step(self): pass
    def save(self, step): pass


loop = Loop(engine, dist, 0, 1, recipe, plan, units, objective, tokenizer.pad_token_id, Tracker(layout, recipe, 0),
            NoCheckpoints(), Reporter(), Faults.from_env(), quiet, lambda: False, backend)


def bare(first, last):  # benchmarks/training.py's bare loop, on the same engine and examples
    tokens = 0
    for step in range(first + 1, last + 1):
        indices = batch_indices(step - 1, recipe.training.seed, len(units), recipe.training.global_batch)
        for micro in range(plan.gradient_accumulation):
            chosen = rank_slice(indices, 0, 1, plan.micro_batch, micro)
            batch = collate(objective.micro_batch([units[i] for i in chosen]), tokenizer.pad_token_id)
            tokens += int(batch["attention_mask"].sum())
            batch = {key: value.to(engine.device) for key, value in batch.items()}
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
    return tokens


def ft(first, last):
    before = loop.tokens
    loop.run(first, last)
    return loop.tokens - before


def timed(side, first, last):
    if cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    tokens = (ft if side == "ft" else bare)(first, last)
    if cuda:
        torch.cuda.synchronize()
    return tokens / (time.perf_counter() - started)


bare(0, warmup)
rates, step = [], warmup
for side in order:
    rates.append(timed(side, step, step + block))
    step += block
print(json.dumps(rates))
"""


def rounds_order(rounds: int) -> list[str]:
    """bare, ft, bare again; rotated every round so that drift over the run hits every side alike."""
    sides = ["bare", "ft", "control"]
    return [side for turn in range(rounds) for side in sides[turn % 3:] + sides[:turn % 3]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10, help="rounds of bare / ft / bare-again blocks")
    parser.add_argument("--block", type=int, default=30, help="steps a block")
    parser.add_argument("--warmup", type=int, default=20, help="bare steps before the first block")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    if args.rounds < 5 or args.block < 10:
        parser.error("at least 5 rounds of 10-step blocks")
    order = rounds_order(args.rounds)
    with tempfile.TemporaryDirectory(prefix="ft-bench-loop-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        code = work / "code"  # a copy: editing the checkout meanwhile changes nothing measured
        shutil.copytree(REPO / "toolkit", code / "toolkit", ignore=shutil.ignore_patterns("__pycache__"))
        model = build_model(work, args.hidden, args.layers)
        spec = work / "recipe.json"
        spec.write_text(json.dumps(spec_for(model, args.warmup + args.block * len(order), None, args.device)))
        run_dir = work / "run"
        (run_dir / "logs").mkdir(parents=True)
        env = environment(work, 29661, args.device) | {"FT_RUN_DIR": str(run_dir), "FT_RUN_ID": "bench"}
        output = subprocess.run([sys.executable, "-c", BLOCKS, str(spec), json.dumps(order), str(args.block),
                                 str(args.warmup), str(work / "cache")], env=env, cwd=code, check=True,
                                capture_output=True, text=True)
    rates = json.loads(output.stdout.strip().splitlines()[-1])
    report(args, order, rates)


def report(args, order: list[str], rates: list[float]) -> None:
    ratios, controls = [], []
    for start in range(0, len(order), 3):
        by_side = dict(zip(order[start:start + 3], rates[start:start + 3], strict=True))
        ratios.append(by_side["ft"] / by_side["bare"])
        controls.append(by_side["control"] / by_side["bare"])
        print(f"  round {start // 3 + 1:2d} ({', '.join(order[start:start + 3])}): bare {by_side['bare']:8.0f} "
              f"tok/s, ft {by_side['ft']:8.0f} (x{ratios[-1]:.3f}), bare again {by_side['control']:8.0f} "
              f"(x{controls[-1]:.3f})")
    median = statistics.median(ratios)
    print(f"model {args.hidden}x{args.layers} on {args.device}, one process, {args.rounds} rounds of "
          f"{args.block}-step blocks")
    print(f"  ft loop / bare  x{median:.3f} median, spread x{min(ratios):.3f} .. x{max(ratios):.3f} "
          f"({'met' if median >= 0.97 else 'MISSED'} target >= 0.97x)")
    print(f"  bare / bare     x{statistics.median(controls):.3f} median, spread x{min(controls):.3f} .. "
          f"x{max(controls):.3f} (identical blocks: the floor)")


if __name__ == "__main__":
    main()
