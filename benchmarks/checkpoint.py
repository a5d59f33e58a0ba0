"""Benchmark ft's checkpoints against bare DeepSpeed and plain s3fs, in one run on one machine.

One rank (gloo and fp32 on the CPU; --device cuda: NCCL and bf16), a Llama of --hidden x --layers
fully fine-tuned with AdamW under ZeRO-2, so a checkpoint holds hundreds of MB:

  stall     how long training stands still per save: ft's (the snapshot into host memory; the
            write goes on in the background) against a bare synchronous engine.save_checkpoint of
            the same state. Target: <= 5%.
  overhead  the wall clock a save costs training in all (the stall, and the background write's
            competition with the steps that run beside it): blocks of --between steps with a save
            at their start against the same blocks without, alternating, the writes waited for at
            each block's end. As a share of wall clock at ft's default cadence (a save every 100
            steps). Target: <= 1%.
  upload    ft's mirror upload of a published checkpoint (toolkit/checkpoint/remote.py) against a
            plain s3fs put of the same files, to a real S3 server (SeaweedFS on loopback, started
            here), alternating. Target: >= 0.9x.

    python benchmarks/checkpoint.py [--hidden 768] [--layers 6] [--saves 5] [--between 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.training import build_model, environment  # noqa: E402 - the checkout's own toolkit

RANK = r"""
import json, sys, time
from pathlib import Path
import deepspeed, torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from toolkit.train.checkpoint import Checkpointer, Tiers
from toolkit.checkpoint.shared import SharedTier
from toolkit.checkpoint.status import StatusBoard

model_dir, work, device = sys.argv[1], Path(sys.argv[2]), sys.argv[5]
saves, between = int(sys.argv[3]), int(sys.argv[4])
backend = "nccl" if device == "cuda" else "gloo"
if device == "cuda":
    torch.cuda.set_device(0)
deepspeed.init_distributed(dist_backend=backend)
torch.manual_seed(0)
dtype = torch.bfloat16 if device == "cuda" else torch.float32
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
          "zero_optimization": {"stage": 2}, "steps_per_print": 10**9}
if device == "cuda":
    config["bf16"] = {"enabled": True}
engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
tokens = torch.randint(3, model.config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
batch = tokens.to(engine.device)

def sync():
    if device == "cuda":
        torch.cuda.synchronize()

saver = None

def steps(count):
    began = time.monotonic()
    for _ in range(count):
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        if saver is not None:
            saver.before_optimizer_step()  # as ft's loop does: the last save's copy is taken first
        engine.step()
    sync()
    return time.monotonic() - began

steps(3)  # warm up
bare = []
for index in range(saves):  # DeepSpeed's own engine, synchronous: the baseline
    steps(1)
    began = time.monotonic()
    engine.save_checkpoint(str(work / "bare"), tag=f"bare-{index}")
    sync()
    bare.append(time.monotonic() - began)

class Progress:
    def report(self, *args):
        pass

saver = Checkpointer(Tiers(SharedTier(work / "ft", 2), None), engine, dist, 0, 1, Progress(), lambda m: None,
                     frozen_excluded=False, lineage="bench", asynchronous=True, board=StatusBoard(None, None))
stalls, plain, saved = [], [], []
step = 0
for index in range(saves + 1):  # the first pair warms ft's host buffers: left out
    plain.append(steps(between))
    began = time.monotonic()
    step += between
    saver.save(step)
    stalls.append(time.monotonic() - began)
    steps(between)
    saver.writer.wait()  # the write's whole cost lands in this block
    saved.append(time.monotonic() - began)
saver.close(upload_wait=0)
state_bytes = sum(f.stat().st_size for f in (work / "ft").rglob("*") if f.is_file() and f.name != "latest")
# Training's pause per save: the save call, and the wait of the next optimizer step for its copy.
stalls = saver.stalls
print("RESULT " + json.dumps({"bare": bare, "stalls": stalls[1:], "plain": plain[1:], "saved": saved[1:],
                              "between": between, "write_seconds": saver.writer.write_seconds,
                              "state_mb": state_bytes / 2**20 / 2}), flush=True)
"""


def run_rank(work: Path, model: Path, args) -> dict:
    env = environment(work, 29641, args.device)
    result = subprocess.run([sys.executable, "-c", RANK, str(model), str(work), str(args.saves), str(args.between),
                             args.device], capture_output=True, text=True, env=env, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"the benchmark rank failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def upload_rates(folder: Path, rounds: int) -> tuple[list[float], list[float], int]:
    """MB/s of ft's upload and of a plain s3fs put of the same files, alternating (SeaweedFS on loopback)."""
    from tests.support.s3 import filesystem, s3_server
    from toolkit.checkpoint import manifest
    from toolkit.checkpoint.remote import RemoteTier

    described = manifest.read(folder)
    with tempfile.TemporaryDirectory() as scratch, s3_server(Path(scratch)) as server:
        fs = filesystem(server.env)
        fs.mkdir("bench")
        ours, theirs = [], []
        for index in range(rounds):
            for side in (("ft", "put") if index % 2 == 0 else ("put", "ft")):
                began = time.monotonic()
                if side == "ft":
                    RemoteTier(f"s3://bench/ft-{index}", keep_last=1, filesystem=fs).upload(folder, described)
                else:
                    fs.put(str(folder) + "/", f"bench/put-{index}/", recursive=True)
                rate = described.total_bytes / 1e6 / (time.monotonic() - began)
                (ours if side == "ft" else theirs).append(rate)
                fs.rm(f"bench/{side}-{index}", recursive=True)
    return ours, theirs, described.total_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--saves", type=int, default=5, help="saves measured on each side")
    parser.add_argument("--between", type=int, default=8, help="training steps in each timed block")
    parser.add_argument("--uploads", type=int, default=6, help="upload rounds (alternating ft and plain put)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ft-bench-ckpt-") as scratch:
        work = Path(scratch)
        model = build_model(work, args.hidden, args.layers)
        result = run_rank(work, model, args)
        newest = max((p for p in (work / "ft").iterdir() if p.name.startswith("step-")), key=lambda p: p.name)
        ours, theirs, size = upload_rates(newest, args.uploads)
    report(args, result, ours, theirs, size)


def report(args, result: dict, ours: list[float], theirs: list[float], size: int) -> None:
    bare, stall = statistics.median(result["bare"]), statistics.median(result["stalls"])
    step_s = statistics.median(result["plain"]) / result["between"]
    per_save = statistics.median(s - p for s, p in zip(result["saved"], result["plain"], strict=True))
    share = max(per_save, 0) / (max(per_save, 0) + 100 * step_s)
    print(f"model {args.hidden}x{args.layers} on {args.device}, checkpoint state {result['state_mb']:.0f} MB, "
          f"step {step_s:.3f} s, {len(result['stalls'])} saves a side")
    print(f"  stall per save  ft {stall:.3f} s (snapshot)   bare synchronous save {bare:.3f} s   "
          f"ratio {stall / bare:.3f} (target <= 0.05)   [ft {', '.join(f'{s:.3f}' for s in result['stalls'])}]")
    print(f"  cost per save   {per_save:.3f} s of wall clock in all (the write in the background: "
          f"{result['write_seconds'] / (len(result['stalls']) + 1):.2f} s a save)")
    print(f"  at the default cadence (every 100 steps): {share:.2%} of wall clock (target <= 1%)")
    print(f"  upload of {size / 1e6:.0f} MB  ft {statistics.median(ours):.0f} MB/s   plain s3fs put "
          f"{statistics.median(theirs):.0f} MB/s   ratio {statistics.median(ours) / statistics.median(theirs):.2f} "
          "(target >= 0.9)")


if __name__ == "__main__":
    main()
