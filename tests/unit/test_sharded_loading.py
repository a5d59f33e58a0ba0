"""Under ZeRO-3 the base model is partitioned as it loads (toolkit/train/models.py: DeepSpeed's
zero.Init through transformers' HfDeepSpeedConfig): two real gloo ranks load a tiny Llama, and each
holds only its part of every weight, never the whole; gathered, the weights are exactly the files';
with LoRA on top, DeepSpeed's engine computes the same loss as the model loaded whole. The lab's
ZeRO-3 run (tests/lab/test_training.py) trains and resumes this way; benchmarks/memory.py measures
the host memory it saves."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.unit.test_checkpoint_snapshot import free_port

torch = pytest.importorskip("torch", reason="the training stack (ft[train]) is not installed")

RANK_SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import deepspeed, torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from toolkit.recipe.schema import MethodSpec, TrainingSpec
    from toolkit.train.models import trainable_model

    model_dir = Path(sys.argv[1])
    deepspeed.init_distributed("gloo")
    rank = dist.get_rank()
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 3}, "steps_per_print": 10**9}
    method = MethodSpec.model_validate({"kind": "lora", "rank": 4, "alpha": 8, "dropout": 0.0})
    training = TrainingSpec.model_validate({"global_batch": 2, "precision": "fp32", "zero_stage": 3})
    torch.manual_seed(0)
    model = trainable_model(model_dir, method, training, zero3=config)
    base = {name.removeprefix("base_model.model.").replace(".base_layer", ""): p
            for name, p in model.named_parameters() if "lora_" not in name}
    held = {name: (p.ds_tensor.numel(), p.ds_numel, p.numel()) for name, p in base.items()}
    files = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        files.update(load_file(path))
    with deepspeed.zero.GatheredParameters(list(base.values())):
        equal = all(torch.equal(base[name].detach(), files[name]) for name in files if name in base)
        missing = sorted(set(files) - set(base))
    engine, *_ = deepspeed.initialize(model=model, config=config,
                                      model_parameters=[p for p in model.parameters() if p.requires_grad])
    batch = torch.arange(3, 19).reshape(1, 16) % 60
    with torch.no_grad():
        sharded_loss = engine(input_ids=batch, labels=batch).loss.item()
    print("RESULT " + json.dumps({"rank": rank, "held": held, "equal": equal, "missing": missing,
                                  "loss": sharded_loss}), flush=True)
""")

WHOLE_LOSS = textwrap.dedent("""
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
    batch = torch.arange(3, 19).reshape(1, 16) % 60
    with torch.no_grad():
        print("RESULT " + json.dumps({"loss": model(input_ids=batch, labels=batch).loss.item()}), flush=True)
""")

ENV = {"PATH": "/usr/bin:/bin", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def result(output: str) -> dict:
    return json.loads(next(line for line in output.splitlines() if line.startswith("RESULT ")).removeprefix("RESULT "))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from toolkit.train.tiny import build_model

    path = tmp_path_factory.mktemp("tiny")
    build_model(path, vocab_size=64, hidden=64, layers=2)
    return path


def test_under_zero3_each_rank_holds_only_its_part_of_every_weight_and_the_loss_is_the_whole_models(tiny_model):
    port = free_port()
    env = {**ENV, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(tiny_model)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}) for rank in (0, 1)]
    outputs = [rank.communicate(timeout=300)[0] for rank in ranks]
    for process, output in zip(ranks, outputs, strict=True):
        assert process.returncode == 0, output[-4000:]
    found = [result(output) for output in outputs]
    whole = subprocess.run([sys.executable, "-c", WHOLE_LOSS, str(tiny_model)], capture_output=True, text=True,
                           env=ENV, timeout=300)
    assert whole.returncode == 0, whole.stderr[-4000:]

    for rank in found:
        assert rank["held"] and rank["equal"] and rank["missing"] == []
        for name, (part, total, materialised) in rank["held"].items():
            # Never the whole weight: its part (half, rounded up) and an empty placeholder.
            assert materialised == 0 and part <= -(-total // 2), (name, part, total)
        assert rank["loss"] == pytest.approx(result(whole.stdout)["loss"], abs=1e-5)
    parts, totals = zip(*((part, total) for part, total, _ in found[0]["held"].values()), strict=True)
    assert sum(parts) < sum(totals)
