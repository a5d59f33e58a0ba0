"""Host memory of the ranks loading a model under ZeRO-3, today's loading beside the old one (issue 35
item 1), in one run on this machine:

  whole     each rank loads the whole model, then DeepSpeed partitions it (ft before session 23)
  sharded   each parameter partitioned as it is made and filled from the files a layer at a time
            (toolkit/train/models.py: zero.Init through transformers' HfDeepSpeedConfig)

N gloo ranks on this host (one node's ranks), a Llama-shaped model with random weights built
locally, LoRA on top, ZeRO-3, then one training step. The peak of the ranks' memory together is the
sum of their PSS (proportional set size: pages the ranks share, the libraries and the page cache's
mapped model files, counted once among them), sampled every 0.1 s from /proc/<pid>/smaps_rollup.
Printed against the model's bytes in the training precision.

    python benchmarks/memory.py [--ranks 4] [--hidden 1024] [--layers 16] [--vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RANK = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import deepspeed, torch
    import torch.distributed as dist
    from toolkit.recipe.schema import MethodSpec, TrainingSpec
    from toolkit.train.models import trainable_model

    model_dir, sharded = Path(sys.argv[1]), sys.argv[2] == "sharded"
    deepspeed.init_distributed("gloo")
    world = dist.get_world_size()
    config = {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}, "steps_per_print": 10**9}
    method = MethodSpec.model_validate({"kind": "lora", "rank": 8, "alpha": 16, "dropout": 0.0})
    training = TrainingSpec.model_validate({"global_batch": world, "precision": "bf16", "zero_stage": 3})
    began = time.monotonic()
    model = trainable_model(model_dir, method, training, zero3=config if sharded else None)
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    loaded = time.monotonic() - began
    batch = torch.arange(64).reshape(1, 64) % 1000
    engine.backward(engine(input_ids=batch, labels=batch).loss)
    engine.step()
    if dist.get_rank() == 0:
        print(f"LOADED {loaded:.1f}", flush=True)
""")


def pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(model_dir: Path, mode: str, ranks: int) -> dict:
    env = {"PATH": "/usr/bin:/bin", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO), "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    processes = [subprocess.Popen([sys.executable, "-c", RANK, str(model_dir), mode], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True,
                                  env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}) for rank in range(ranks)]
    peak, began = 0, time.monotonic()
    while any(p.poll() is None for p in processes):
        peak = max(peak, sum(pss_kib(p.pid) for p in processes))
        time.sleep(0.1)
    outputs = [p.stdout.read() for p in processes]
    for process, output in zip(processes, outputs, strict=True):
        if process.returncode != 0:
            raise SystemExit(f"a {mode} rank failed:\n{output[-3000:]}")
    loaded = next(float(line.split()[1]) for line in outputs[0].splitlines() if line.startswith("LOADED "))
    return {"peak_gib": peak / 2**20, "seconds": time.monotonic() - began, "load_seconds": loaded}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    from toolkit.train.tiny import build_model

    with tempfile.TemporaryDirectory(prefix="ft-bench-memory-") as folder:
        model_dir = Path(folder) / "model"
        build_model(model_dir, vocab_size=args.vocab, hidden=args.hidden, layers=args.layers)
        # Stored in bf16, as released checkpoints are: the ranks map the same file pages (a file in
        # another precision is cast on every rank, and that copy is the rank's own).
        import torch
        from transformers import AutoModelForCausalLM

        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).save_pretrained(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        parameters = (args.vocab * args.hidden * 2 + args.layers * (4 * args.hidden**2 + 3 * 2 * args.hidden**2))
        gib = parameters * 2 / 2**30  # bf16
        print(f"model: Llama-shaped, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab} "
              f"({parameters / 1e6:.0f}M parameters, {gib:.2f} GiB in bf16; {config['model_type']}); "
              f"{args.ranks} ranks, ZeRO-3, LoRA r8", flush=True)
        found = {}
        for mode in ("whole", "sharded"):
            found[mode] = run(model_dir, mode, args.ranks)
            print(f"  {mode:8s} peak PSS of the ranks together {found[mode]['peak_gib']:.2f} GiB "
                  f"({found[mode]['peak_gib'] / gib:.1f}x the model); loading {found[mode]['load_seconds']:.0f} s, "
                  f"in all {found[mode]['seconds']:.0f} s", flush=True)
        print(f"sharded / whole: {found['sharded']['peak_gib'] / found['whole']['peak_gib']:.2f}x the peak, "
              f"{found['whole']['peak_gib'] - found['sharded']['peak_gib']:.2f} GiB less (a whole copy per rank: "
              f"{args.ranks} x {gib:.2f} GiB)")


if __name__ == "__main__":
    main()
