"""Benchmark ft's training runtime against a bare DeepSpeed loop, in one run on one machine.

One rank (gloo and fp32 on the CPU; with --device cuda, NCCL and bf16 on one GPU), the same model,
data, batches and DeepSpeed configuration:

  bare loop        deepspeed.initialize + forward/backward/step, nothing else
  ft worker        toolkit.train.worker (token cache, metrics, per-step agreement, NaN checks), no checkpoints
  ft checkpoints   the same with a checkpoint every --every steps

Robust on a shared, noisy machine: --pairs alternating bare / ft runs (the order flips every pair,
so drift hits both sides alike), the first --warmup steps of every run excluded, and the median
ratio printed with its spread (target: ft >= 0.97x the bare loop). With --control every pair runs
the bare loop twice (the three runs rotated): the second's ratio to the first is what identical
code scatters to on this machine, the floor under any figure the pairs give. Steps are timed as they finish:
the bare loop stamps each (synchronising the GPU at the two stamps the rate is taken between); on
the CPU ft's metrics.jsonl lines carry their step's end, on a GPU they are stamped as they appear,
which is when ft reads its losses (every 10 steps, a synchronisation): --warmup and --steps are
multiples of 10.
Then the per-step cost of each piece ft adds, measured on its own in one process with ft's own
classes: the loss window read every 10 steps with its metrics lines, the per-step agreement (a CPU
collective), the NaN check, the stop flag, and the token cache's load. Finally the time each ft
checkpoint costs against a bare synchronous engine.save_checkpoint of the same state, and what
checkpoints cost at ft's default cadence (every 100 steps; target <= 1% of wall clock).
The model is a Llama of --hidden x --layers, fully fine-tuned, so a checkpoint holds hundreds of
MB (weights and Adam state).
    python benchmarks/training.py [--pairs 5] [--steps 40] [--warmup 10] [--hidden 768] [--layers 6] [--control]
    python benchmarks/training.py --hidden 64 --layers 2 --steps 300 --warmup 50 --control   # host-bound steps
    python benchmarks/training.py --device cuda --hidden 2048 --layers 8      # on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from toolkit.launch.warm import CPU_MALLOC  # noqa: E402 - the checkout's own toolkit

DATA = REPO / "recipes" / "data" / "tiny-sft.jsonl"
# The code every run imports: a copy of the checkout's toolkit taken at the start (main), so that
# editing the checkout during a run of many minutes changes no pair (it once broke one).
CODE = REPO
PRECISION = {"cpu": "fp32", "cuda": "bf16"}
LOG_EVERY_STEPS = 10  # the recipe's default: ft reads losses every 10 steps

BARE_LOOP = r"""
import json, os, sys, time
from pathlib import Path
import deepspeed, torch
from transformers import AutoModelForCausalLM
from toolkit.data.encode import encode_rows
from toolkit.data.readers import open_rows
from toolkit.data.tokenizer import load_length_counter
from toolkit.recipe.run_spec import RunSpec, batch_plan
from toolkit.train.data import Example, batch_indices, collate, rank_slice
from toolkit.train.engine import deepspeed_config
from toolkit.storage.object_store import ObjectStore

recipe = RunSpec.model_validate_json(Path(sys.argv[1]).read_text()).recipe
warmup, steps = int(sys.argv[3]), recipe.training.steps
backend = os.environ["FT_DIST_BACKEND"]
if backend == "nccl":
    torch.cuda.set_device(0)
deepspeed.init_distributed(dist_backend=backend)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(recipe.model.base, dtype=torch.float32)
counter = load_length_counter(recipe.model.base)
rows = [r.data for r in open_rows(recipe.data.train, ObjectStore())[0] if r.data]
examples = [Example(i, l) for i, l, _ in encode_rows(rows, "prompt_completion", counter, recipe.data.max_seq_len)]
config = deepspeed_config(recipe.training, batch_plan(recipe.training, 1), steps)
engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
tokens, started, stamps, step_tokens = 0, time.monotonic(), [], []
for step in range(1, steps + 1):
    indices = batch_indices(step - 1, 42, len(examples), config["train_batch_size"])
    for micro in range(config["gradient_accumulation_steps"]):
        chosen = rank_slice(indices, 0, 1, config["train_micro_batch_size_per_gpu"], micro)
        batch = collate([examples[i] for i in chosen], 2)
        tokens += int(batch["attention_mask"].sum())
        batch = {key: value.to(engine.device) for key, value in batch.items()}
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
    if backend == "nccl" and step in (warmup, steps):  # the two stamps the rate is taken between
        torch.cuda.synchronize()
    stamps.append(time.monotonic())
    step_tokens.append(tokens)
seconds = time.monotonic() - started
save_started = time.monotonic()
engine.save_checkpoint(sys.argv[2], tag="bare")
save_seconds = time.monotonic() - save_started
print(json.dumps({"tokens": tokens, "seconds": seconds, "save_seconds": save_seconds, "stamps": stamps,
                  "step_tokens": step_tokens}))
"""


def build_model(folder: Path, hidden: int, layers: int) -> Path:
    from toolkit.train.tiny import build_model as build_weights
    from toolkit.train.tiny import build_tokenizer

    path = folder / f"llama-h{hidden}-l{layers}"
    tokenizer = build_tokenizer(path)
    build_weights(path, len(tokenizer), hidden=hidden, layers=layers)
    return path


def spec_for(model: Path, steps: int, every: int | None, device: str) -> dict:
    """The run spec (recipe.json) of one rank: the recipe and what the login side derives from it."""
    derived = {"workers_per_node": 1, "world_size": 1, "gradient_accumulation": 2, "out_of_memory_micro_batch": 2,
               "partition": "bench", "qos": None}
    return {"derived": derived, "recipe": {
        "name": "bench", "model": {"base": str(model), "revision": None, "params_b": None},
        "method": {"kind": "full", "rank": None, "alpha": None, "dropout": 0.0, "target_modules": None},
        "objective": {"kind": "sft", "beta": None},
        "data": {"train": str(DATA), "eval": None, "format": "prompt_completion", "max_seq_len": 128,
                 "eval_fraction": 0.0, "too_long": "reject"},
        "training": {"steps": steps, "epochs": None, "learning_rate": 1e-4, "lr_schedule": "constant",
                     "warmup_steps": 0, "micro_batch": 4, "global_batch": 8, "precision": PRECISION[device], "seed": 42,
                     "zero_stage": 2, "gradient_checkpointing": False, "max_grad_norm": 1.0},
        "checkpoint": {"every_steps": every, "every_minutes": None, "keep_last": 2, "staging": None,
                       "s3_mirror": None},
        "tracking": {"wandb": {"project": None, "entity": None, "mode": "disabled", "tags": []},
                     "log_every_steps": LOG_EVERY_STEPS},
        "env": {},
    }}


def environment(work: Path, port: int, device: str) -> dict:
    common = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=str(port))
    if device == "cuda":
        return common | {"FT_DIST_BACKEND": "nccl", "TORCH_EXTENSIONS_DIR": str(work / "torch_extensions")}
    # Both sides get what ft's launcher gives a CPU worker (toolkit.launch.workers.worker_env).
    return common | CPU_MALLOC | {"FT_DIST_BACKEND": "gloo", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "2",
                                  "TORCH_EXTENSIONS_DIR": "/var/lib/ft-lab/shared/cache/torch_extensions"}


PIECES = r"""
import json, math, os, sys, tempfile, time
from pathlib import Path
import deepspeed, torch
import torch.distributed as dist
from toolkit.train.step_signals import Agreement, LossWindow
from toolkit.recipe.run_spec import RunSpec
from toolkit.runs.layout import RunLayout
from toolkit.train.tracking import Tracker

backend, repeat, every = os.environ["FT_DIST_BACKEND"], int(sys.argv[1]), int(sys.argv[2])
device = "cuda" if backend == "nccl" else "cpu"
if device == "cuda":
    torch.cuda.set_device(0)
deepspeed.init_distributed(dist_backend=backend)

def per_call(function):
    function()
    if device == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeat):
        function()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeat

loss = torch.tensor(2.5, device=device)
window, agreement = LossWindow(every, 1), Agreement(dist, backend)
with tempfile.TemporaryDirectory() as folder:
    tracker = Tracker(RunLayout(Path(folder)), RunSpec.model_validate_json(open(sys.argv[3]).read()).recipe, 0)

    def read_window():  # a window of `every` steps: stack, collective, one read; per step
        for step in range(every):
            window.add(step, loss, None, 1e-4, 1234)
        return tracker.log(window.read(dist))

    costs = {f"loss window + metrics (read every {every} steps)": per_call(read_window) / every,
             "agreement (CPU collective of 2 flags)": per_call(lambda: agreement.agree(False, False)),
             "NaN check": per_call(lambda: math.isfinite(2.5)),
             "signal flag (stop requested?)": per_call(lambda: float(False) > 0)}
print(json.dumps(costs))
"""

TOKEN_CACHE_LOAD = r"""
import json, sys, time
from pathlib import Path
from toolkit.data.recipe_data import dataset_key, token_cache
from toolkit.data.tokenizer import load_length_counter
from toolkit.recipe.run_spec import RunSpec
from toolkit.train.dataset import build_cache
from toolkit.storage.object_store import ObjectStore

recipe = RunSpec.model_validate_json(open(sys.argv[1]).read()).recipe
counter = load_length_counter(recipe.model.base)
key = dataset_key(recipe, recipe.data.train, counter, "train", ObjectStore())
cache = token_cache(Path(sys.argv[2]))
if cache.meta(key) is None:
    build_cache(recipe, counter, cache, key)
started = time.perf_counter()
cache.meta(key)  # rank 0: digests
dataset = cache.load(key, digests=False)
examples = dataset.examples()
print(json.dumps({"seconds": time.perf_counter() - started, "sequences": len(examples)}))
"""


def watch_metrics(path: Path, stamps: dict, stop: threading.Event) -> None:
    """Stamp each metrics line as it appears: when the worker finished that step. Between lines it
    only stats the file (microseconds): reading it each time would take CPU from the worker."""
    size = 0
    while not stop.is_set():
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_size != size:
                now = time.monotonic()
                with open(path, "rb") as handle:
                    handle.seek(size)
                    chunk = handle.read()
                complete = chunk[:chunk.rfind(b"\n") + 1]  # a line still being written waits
                size += len(complete)
                for line in complete.splitlines():
                    with contextlib.suppress(ValueError):
                        entry = json.loads(line)
                        stamps[entry["step"]] = (now, entry["tokens"])
        time.sleep(0.005)


def run_ft(work: Path, name: str, spec: dict, port: int, device: str) -> dict:
    run_dir = work / name
    (run_dir / "logs").mkdir(parents=True)
    # What ft's render writes from the cluster profile (toolkit/recipe/job_plan.py SitePlan).
    site = {"distributed_backend": "nccl" if device == "cuda" else "gloo", "shared_root": str(work / "shared")}
    (run_dir / "recipe.json").write_text(json.dumps(spec | {"site": site}))
    env = environment(work, port, device) | {"FT_RUN_DIR": str(run_dir), "FT_RUN_ID": name}
    stamps: dict[int, tuple[float, int]] = {}
    stop = threading.Event()
    # On the CPU a step has finished when the host has queued it: each metrics line's own time is
    # when its step ended, and no watcher thread takes a core from the worker's two compute
    # threads (the bare side has none). On a GPU the lines are stamped as they appear.
    watcher = threading.Thread(target=watch_metrics, args=(run_dir / "metrics.jsonl", stamps, stop), daemon=True)
    if device == "cuda":
        watcher.start()
    try:
        with open(run_dir / "logs" / "rank-0.log", "w") as log:
            subprocess.run([sys.executable, "-m", "toolkit.train.worker"], env=env, check=True, cwd=CODE,
                           stdout=log, stderr=subprocess.STDOUT)
    finally:
        stop.set()
        if watcher.is_alive():
            watcher.join()
    if device != "cuda":
        for entry in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
            stamps[entry["step"]] = (entry["time"], entry["tokens"])
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary | {"stamps": [stamps[step][0] for step in sorted(stamps)],
                      "step_tokens": [stamps[step][1] for step in sorted(stamps)]}


def rate_after_warmup(result: dict, warmup: int) -> float:
    """Tokens per second from the end of step `warmup` to the end of the last step. ft writes its
    metrics lines when it reads the losses (every LOG_EVERY_STEPS steps, a synchronisation), so both
    ends are steps where it reads them: their lines appear when the step has truly finished."""
    stamps, tokens = result["stamps"], result["step_tokens"]
    return (tokens[-1] - tokens[warmup - 1]) / (stamps[-1] - stamps[warmup - 1])


def run_bare(work: Path, model: Path, args, checkpoint: str) -> dict:
    recipe_path = work / "bare.json"
    recipe_path.write_text(json.dumps(spec_for(model, args.steps, None, args.device)))
    output = subprocess.run([sys.executable, "-c", BARE_LOOP, str(recipe_path), str(work / checkpoint),
                             str(args.warmup)], env=environment(work, 29611, args.device), check=True,
                            capture_output=True, text=True, cwd=CODE)
    return json.loads(output.stdout.strip().splitlines()[-1])


def run_script(script: str, arguments: list[str], env: dict) -> dict:
    output = subprocess.run([sys.executable, "-c", script, *arguments], env=env, check=True, capture_output=True,
                            text=True, cwd=CODE)
    return json.loads(output.stdout.splitlines()[-1])


def measure_pieces(work: Path, model: Path, args) -> tuple[dict, dict]:
    recipe_path = work / "cache.json"
    recipe_path.write_text(json.dumps(spec_for(model, args.steps, None, args.device)))
    pieces = run_script(PIECES, ["200", str(LOG_EVERY_STEPS), str(recipe_path)], environment(work, 29641, args.device))
    cache = run_script(TOKEN_CACHE_LOAD, [str(recipe_path), str(work / "cache")], environment(work, 29651, args.device))
    return pieces, cache


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=5, help="alternating bare / ft runs (at least 5 for the target)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10, help="steps excluded at the start of every run")
    parser.add_argument("--every", type=int, default=10, help="checkpoint cadence of the checkpoint run, in steps")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--control", action="store_true",
                        help="run the bare loop a second time in every pair: its ratio to the first is the noise floor")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: one GPU, NCCL, bf16 (give a larger --hidden/--layers)")
    args = parser.parse_args()
    if not 0 < args.warmup < args.steps:
        parser.error("--warmup must be between 0 and --steps")
    if args.warmup % LOG_EVERY_STEPS or args.steps % LOG_EVERY_STEPS:
        parser.error(f"--warmup and --steps must be multiples of {LOG_EVERY_STEPS}, the steps ft reads losses at")
    global CODE
    with tempfile.TemporaryDirectory(prefix="ft-bench-train-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        CODE = work / "code"
        shutil.copytree(REPO / "toolkit", CODE / "toolkit", ignore=shutil.ignore_patterns("__pycache__"))
        model = build_model(work, args.hidden, args.layers)
        ratios, controls, bare_rates, ft_rates, bare_saves = [], [], [], [], []
        for pair in range(args.pairs):
            results = {}
            for side in pair_order(pair, args.control):
                results[side] = (run_bare(work, model, args, f"{side}-ckpt-{pair}") if side in ("bare", "control")
                                 else run_ft(work, f"ft-plain-{pair}", spec_for(model, args.steps, None, args.device),
                                             29621, args.device))
            bare_rate, ft_rate = (rate_after_warmup(results[side], args.warmup) for side in ("bare", "ft"))
            bare_rates.append(bare_rate)
            ft_rates.append(ft_rate)
            ratios.append(ft_rate / bare_rate)
            bare_saves.append(results["bare"]["save_seconds"])
            state_mb = sum(f.stat().st_size for f in (work / f"bare-ckpt-{pair}").rglob("*") if f.is_file()) / 2**20
            for saved in work.glob(f"*-ckpt-{pair}"):  # a larger model's state is many GB: one on disk at a time
                shutil.rmtree(saved)
            line = (f"  pair {pair + 1}/{args.pairs} ({', '.join(pair_order(pair, args.control))}): bare "
                    f"{bare_rate:7.0f} tok/s, ft {ft_rate:7.0f} tok/s, x{ft_rate / bare_rate:.3f}")
            if args.control:
                controls.append(rate_after_warmup(results["control"], args.warmup) / bare_rate)
                line += f"; bare again x{controls[-1]:.3f}"
            print(line, flush=True)
        pieces, cache = measure_pieces(work, model, args)
        checkpointed = run_ft(work, "ft-ckpt", spec_for(model, args.steps, args.every, args.device), 29631,
                              args.device)

    report(args, ratios, controls, bare_rates, ft_rates, bare_saves, pieces, cache, checkpointed, state_mb)


def pair_order(pair: int, control: bool) -> list[str]:
    """The runs of one pair, rotated every pair so that drift over the run hits every side alike."""
    sides = ["bare", "ft", "control"] if control else ["bare", "ft"]
    turn = pair % len(sides)
    return sides[turn:] + sides[:turn]


def report(args, ratios, controls, bare_rates, ft_rates, bare_saves, pieces, cache, checkpointed, state_mb) -> None:
    median = statistics.median(ratios)
    tokens_per_step = checkpointed["step_tokens"][-1] / args.steps  # the same batches in every run
    step_seconds = tokens_per_step / statistics.median(bare_rates)
    print(f"model {args.hidden}x{args.layers} on {args.device} ({PRECISION[args.device]}), checkpoint state "
          f"{state_mb:.0f} MB, {args.steps} steps ({args.warmup} of warm-up excluded), {args.pairs} alternating pairs")
    print(f"  bare loop       {statistics.median(bare_rates):9.0f} tokens/s (median)")
    print(f"  ft worker       {statistics.median(ft_rates):9.0f} tokens/s (median)")
    print(f"  ratio           x{median:.3f} median, spread x{min(ratios):.3f} .. x{max(ratios):.3f} "
          f"({'met' if median >= 0.97 and args.pairs >= 5 else 'MISSED'} target >= 0.97x over >= 5 pairs)")
    if controls:  # the same bare loop against itself: how far apart two runs of identical code land here
        print(f"  bare vs bare    x{statistics.median(controls):.3f} median, spread x{min(controls):.3f} .. "
              f"x{max(controls):.3f} (the noise floor: identical code, the same pairs)")
    print(f"  per-step cost of what ft adds (a step of the bare loop: {step_seconds * 1e3:.1f} ms):")
    for piece, seconds in pieces.items():
        print(f"    {piece:48s} {seconds * 1e6:9.1f} us  ({seconds / step_seconds * 100:.3f}% of a step)")
    print(f"    {'token cache load (once per run)':48s} {cache['seconds'] * 1e3:9.1f} ms  "
          f"({cache['seconds'] / (step_seconds * args.steps) * 100:.3f}% of {args.steps} steps)")
    per_checkpoint = checkpointed["checkpoint_seconds"] / checkpointed["checkpoints"]
    share = per_checkpoint / (per_checkpoint + 100 * step_seconds)
    print(f"  ft checkpoint   {per_checkpoint:6.2f} s each   bare synchronous save "
          f"{statistics.median(bare_saves):.2f} s (median)")
    print(f"  at the default cadence (every 100 steps of {step_seconds:.2f} s): {share * 100:.2f}% of wall clock "
          f"({'met' if share <= 0.01 else 'MISSED'} target <= 1%)")


if __name__ == "__main__":
    main()
