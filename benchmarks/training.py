"""Benchmark ft's training runtime against a bare DeepSpeed loop, in one run on this machine.

One rank (gloo on the CPU), the same model, data, batches and DeepSpeed configuration:

  bare loop        deepspeed.initialize + forward/backward/step, nothing else
  ft worker        toolkit.train.worker (token cache, metrics, signals, NaN checks), no checkpoints
  ft checkpoints   the same with a checkpoint every --every steps

Prints tokens per second (target: ft >= 0.97x the bare loop), the time each ft checkpoint costs
against a bare synchronous engine.save_checkpoint of the same state, and what checkpoints cost
at ft's default cadence (every 100 steps; target <= 1% of wall clock).
The model is a Llama of --hidden x --layers, fully fine-tuned, so a checkpoint holds hundreds of
MB (weights and Adam state).   python benchmarks/training.py [--steps 40] [--hidden 768] [--layers 6]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "recipes" / "data" / "tiny-sft.jsonl"

BARE_LOOP = r"""
import json, os, sys, time
from pathlib import Path
import deepspeed, torch
from transformers import AutoModelForCausalLM
from toolkit.data.encode import encode_rows
from toolkit.data.readers import open_rows
from toolkit.data.tokenizer import load_length_counter
from toolkit.train.data import Example, batch_indices, collate, rank_slice
from toolkit.train.worker import deepspeed_config

recipe = json.loads(Path(sys.argv[1]).read_text())
steps = recipe["training"]["steps"]
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(recipe["model"]["base"], dtype=torch.float32)
counter = load_length_counter(recipe["model"]["base"])
rows = [r.data for r in open_rows(recipe["data"]["train"])[0] if r.data]
examples = [Example(i, l) for i, l, _ in encode_rows(rows, "prompt_completion", counter, recipe["data"]["max_seq_len"])]
config = deepspeed_config(recipe, 1, steps)
engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
tokens, started = 0, time.monotonic()
for step in range(steps):
    indices = batch_indices(step, 42, len(examples), config["train_batch_size"])
    for micro in range(config["gradient_accumulation_steps"]):
        chosen = rank_slice(indices, 0, 1, config["train_micro_batch_size_per_gpu"], micro)
        batch = collate([examples[i] for i in chosen], 2)
        tokens += int(batch["attention_mask"].sum())
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
seconds = time.monotonic() - started
save_started = time.monotonic()
engine.save_checkpoint(sys.argv[2], tag="bare")
save_seconds = time.monotonic() - save_started
print(json.dumps({"tokens": tokens, "seconds": seconds, "save_seconds": save_seconds}))
"""


def build_model(folder: Path, hidden: int, layers: int) -> Path:
    from toolkit.train.tiny import build_model as build_weights
    from toolkit.train.tiny import build_tokenizer

    path = folder / f"llama-h{hidden}-l{layers}"
    tokenizer = build_tokenizer(path)
    build_weights(path, len(tokenizer), hidden=hidden, layers=layers)
    return path


def recipe_for(model: Path, steps: int, every: int | None) -> dict:
    return {
        "name": "bench", "model": {"base": str(model), "revision": None, "params_b": None},
        "method": {"kind": "full", "rank": None, "alpha": None, "dropout": 0.0, "target_modules": None},
        "objective": {"kind": "sft", "beta": None},
        "data": {"train": str(DATA), "eval": None, "format": "prompt_completion", "max_seq_len": 128,
                 "eval_fraction": 0.0, "too_long": "reject"},
        "training": {"steps": steps, "epochs": None, "learning_rate": 1e-4, "lr_schedule": "constant",
                     "warmup_steps": 0, "micro_batch": 4, "global_batch": 8, "precision": "fp32", "seed": 42,
                     "zero_stage": 2, "gradient_checkpointing": False, "max_grad_norm": 1.0},
        "checkpoint": {"every_steps": every, "every_minutes": None, "keep_last": 2, "staging": None,
                       "s3_mirror": None},
        "tracking": {"wandb": {"project": None, "entity": None, "mode": "disabled", "tags": []}},
        "env": {},
    }


def environment(work: Path, port: int) -> dict:
    return dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port), FT_DIST_BACKEND="gloo", DS_ACCELERATOR="cpu", OMP_NUM_THREADS="2",
                FT_SHARED_ROOT=str(work / "shared"),
                TORCH_EXTENSIONS_DIR="/var/lib/ft-lab/shared/cache/torch_extensions")


def run_ft(work: Path, name: str, recipe: dict, port: int) -> dict:
    run_dir = work / name
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "recipe.json").write_text(json.dumps(recipe))
    env = environment(work, port) | {"FT_RUN_DIR": str(run_dir), "FT_RUN_ID": name}
    with open(run_dir / "logs" / "rank-0.log", "w") as log:
        subprocess.run([sys.executable, "-m", "toolkit.train.worker"], env=env, check=True, cwd=REPO,
                       stdout=log, stderr=subprocess.STDOUT)
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="checkpoint cadence of the third run, in steps")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ft-bench-train-", dir="/var/tmp") as tmp:
        work = Path(tmp)
        model = build_model(work, args.hidden, args.layers)
        recipe_path = work / "bare.json"
        recipe_path.write_text(json.dumps(recipe_for(model, args.steps, None)))
        bare = json.loads(subprocess.run(
            [sys.executable, "-c", BARE_LOOP, str(recipe_path), str(work / "bare-ckpt")], env=environment(work, 29611),
            check=True, capture_output=True, text=True, cwd=REPO).stdout.strip().splitlines()[-1])
        plain = run_ft(work, "ft-plain", recipe_for(model, args.steps, None), 29621)
        checkpointed = run_ft(work, "ft-ckpt", recipe_for(model, args.steps, args.every), 29631)
        state_mb = sum(f.stat().st_size for f in (work / "bare-ckpt").rglob("*") if f.is_file()) / 2**20

    bare_rate = bare["tokens"] / bare["seconds"]
    # ft's training time, without its checkpoints (the bare loop saves only after its clock stops).
    training_seconds = plain["wall_seconds"] - plain["checkpoint_seconds"]
    ft_rate = plain["tokens"] / training_seconds
    per_checkpoint = checkpointed["checkpoint_seconds"] / checkpointed["checkpoints"]
    step_seconds = training_seconds / args.steps
    share = per_checkpoint / (per_checkpoint + 100 * step_seconds)
    print(f"model {args.hidden}x{args.layers}, checkpoint state {state_mb:.0f} MB, {args.steps} steps")
    print(f"  bare loop       {bare_rate:9.0f} tokens/s")
    print(f"  ft worker       {ft_rate:9.0f} tokens/s   x{ft_rate / bare_rate:.3f} "
          f"({'met' if ft_rate / bare_rate >= 0.97 else 'MISSED'} target >= 0.97x)")
    print(f"  ft checkpoint   {per_checkpoint:6.2f} s each   bare synchronous save {bare['save_seconds']:.2f} s")
    print(f"  at the default cadence (every 100 steps of {step_seconds:.2f} s): {share * 100:.2f}% of wall clock "
          f"({'met' if share <= 0.01 else 'MISSED'} target <= 1%)")


if __name__ == "__main__":
    main()
