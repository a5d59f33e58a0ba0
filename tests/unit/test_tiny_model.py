"""The tiny model's cache entry is whole whichever rank builds it, and a poisoned entry is rebuilt,
never loaded. Real torch.distributed (gloo) ranks in separate processes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from toolkit.train.tiny import COMPLETE, ensure_tiny_llama

pytest.importorskip("torch", reason="the training stack (ft[train]) is not installed")

# Rank 1 builds while rank 0 waits at a barrier: the build happens under an initialised process
# group in which the builder is not global rank 0 (transformers then writes weights on rank 0 only).
RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from toolkit.train.tiny import ensure_tiny_llama

    dist.init_process_group("gloo")
    rank, cache = dist.get_rank(), Path(sys.argv[1])
    if rank == 1:
        path = ensure_tiny_llama(cache)
    dist.barrier()
    if rank == 0:
        path = ensure_tiny_llama(cache)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    print(json.dumps({"rank": rank, "path": str(path), "params": sum(p.numel() for p in model.parameters()),
                      "vocab": len(tokenizer)}))
    dist.destroy_process_group()
""")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_rank_other_than_zero_builds_a_whole_model_under_torch_distributed(tmp_path):
    cache, port = tmp_path / "models", free_port()
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(cache)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**_base_env(), "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)}) for rank in (0, 1)]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    for process, (_, err) in zip(ranks, outputs, strict=True):
        assert process.returncode == 0, err[-3000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    entry = cache / "tiny-llama-h256-l2"
    assert {result["path"] for result in results} == {str(entry)}
    assert results[0]["params"] == results[1]["params"] > 1_000_000
    assert (entry / "model.safetensors").is_file() and (entry / "config.json").is_file()
    assert not [p for p in cache.iterdir() if p.name.startswith((".building", ".discarded"))]


@pytest.mark.parametrize("poison", ["weights missing", "config missing"])
def test_a_poisoned_entry_is_rebuilt_not_loaded(tmp_path, poison):
    cache = tmp_path / "models"
    entry = ensure_tiny_llama(cache)
    weights = entry / "model.safetensors"
    original = weights.read_bytes()
    if poison == "weights missing":
        weights.unlink()
    else:
        (entry / "config.json").unlink()
    assert (entry / COMPLETE).exists()  # the marker alone must not be trusted
    warnings = []
    assert ensure_tiny_llama(cache, warn=warnings.append) == entry
    assert weights.read_bytes() == original  # deterministic: the rebuild is the same model
    assert len(warnings) == 1 and str(entry) in warnings[0] and "rebuilding" in warnings[0]


def _base_env() -> dict[str, str]:
    import os

    env = {name: value for name, value in os.environ.items()
           if name not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
