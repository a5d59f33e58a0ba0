"""The memory plan (toolkit/recipe/memory_plan.py): its estimates against peaks measured on a GPU
(benchmarks/GPU.md) and on this machine's CPU, within 20%; and the resolver's choices from it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from toolkit.recipe.memory_plan import GIB, LLAMA_SHAPES, LORA_TARGETS_ALL, Setup, Shape, estimate, shape_of
from toolkit.recipe.resolve import RecipeError, resolve

REPO = Path(__file__).resolve().parents[2]


def lora_on_gpu(seq: int, **setup) -> Setup:
    return Setup(**{"method": "lora", "lora_rank": 32, "lora_targets": LORA_TARGETS_ALL, "zero_stage": 2,
                    "ranks": 1, "micro_batch": 1, "seq_len": seq, "precision": "bf16", "checkpointing": False} | setup)


@pytest.mark.parametrize(("layers", "seq", "measured_gib"), [
    (32, 4096, 34.19),  # ft's worker, Llama-3-8B shape, H200, 2026-11-27 (GPU.md: max_memory_allocated)
    (4, 1024, 5.25),  # the same shape cut to 4 layers, the lifecycle run of that call
])
def test_estimates_are_within_a_fifth_of_the_gpu_peaks_measured(layers, seq, measured_gib):
    shape = Shape(4096, 14336, layers, 32, 8, 128256)
    plan = estimate(shape, lora_on_gpu(seq))
    assert 0.8 <= plan.total / (measured_gib * GIB) <= 1.2, [(name, value / GIB) for name, value in plan.parts()]


def test_a_models_shape_comes_from_its_config_else_from_its_size(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "intermediate_size": 128,
                                                      "num_hidden_layers": 2, "num_attention_heads": 4,
                                                      "num_key_value_heads": 2, "vocab_size": 100}))
    assert shape_of(str(tmp_path), 8.0) == Shape(64, 128, 2, 4, 2, 100)
    assert shape_of("meta-llama/Llama-3.1-8B", 8.0) == LLAMA_SHAPES[8.0]
    assert abs(LLAMA_SHAPES[8.0].parameters() / 1e9 - 8.03) < 0.01  # the published 8.03 B
    assert abs(LLAMA_SHAPES[70.6].parameters() / 1e9 - 70.55) < 0.1
    assert shape_of("some/model", None) is None


RECIPE = {"name": "r", "model": {"base": "meta-llama/Llama-3.1-8B"}, "data": {"train": "/d/train.jsonl"},
          "resources": {"nodes": 1, "gpus_per_node": 8}}


def resolved(tmp_path, **changes):
    recipe = json.loads(json.dumps(RECIPE))
    for dotted, value in changes.items():
        section, name = dotted.split("__")
        recipe.setdefault(section, {})[name] = value
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return resolve(path, "hyperpod")


def test_the_resolver_chooses_the_fastest_setup_that_fits(tmp_path):
    roomy = resolved(tmp_path, data__max_seq_len=4096)  # 8B LoRA, micro batch 1: ~37 GiB of an 80 GB H100
    assert roomy.recipe.training.zero_stage == 1 and roomy.recipe.training.gradient_checkpointing is False
    assert roomy.sources["training.gradient_checkpointing"].startswith("default: the memory plan: ")
    tight = resolved(tmp_path, data__max_seq_len=8192, training__micro_batch=2)  # without: ~150 GiB
    assert tight.recipe.training.gradient_checkpointing is True
    plan, budget = tight.memory
    assert plan.total <= budget
    full = resolved(tmp_path, method__kind="full")  # 8B full: 16 GB of weights, 96 GB of optimizer state / 8
    assert full.recipe.training.zero_stage in (2, 3)
    explicit = resolved(tmp_path, training__gradient_checkpointing=True, training__zero_stage=2)
    assert explicit.recipe.training.gradient_checkpointing is True and explicit.recipe.training.zero_stage == 2
    assert explicit.sources["training.zero_stage"] == "recipe"


def test_a_recipe_that_cannot_fit_is_refused_naming_what_would(tmp_path):
    with pytest.raises(RecipeError) as caught:  # 8B LoRA, 32k tokens, micro batch 2, no checkpointing asked
        resolved(tmp_path, training__gradient_checkpointing=False, training__micro_batch=2, data__max_seq_len=32768)
    [problem] = [p for p in caught.value.problems if "memory plan" in p]
    assert "training.micro_batch" in problem and "more than the 74.2 GiB a rank has" in problem
    assert problem.endswith("Each of these would fit: training.gradient_checkpointing: true (42.1 GiB)")
    with pytest.raises(RecipeError) as caught:  # 70B full fine-tuning on one node: nothing alone fits
        resolved(tmp_path, model__base="meta-llama/Llama-3.1-70B", method__kind="full", data__max_seq_len=8192)
    [problem] = [p for p in caught.value.problems if "memory plan" in p]
    assert "combine them" in problem or "resources.nodes: 2" in problem


def test_the_resolver_writes_packing_and_compile_down(tmp_path):
    """Left open, they are decided at submit and recorded: a later default never changes a run."""
    gpu = resolved(tmp_path)
    assert gpu.recipe.data.packing is True and gpu.recipe.training.compile is True
    dpo = resolved(tmp_path, objective__kind="dpo")
    assert dpo.recipe.data.packing is False
    assert resolved(tmp_path, training__zero_stage=3, method__kind="full").recipe.training.compile is False


def test_explain_shows_the_plan(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(RECIPE))
    out = subprocess.run([sys.executable, "-m", "toolkit", "recipe", "explain", str(path), "--cluster", "hyperpod",
                          "--json"], capture_output=True, text=True, cwd=REPO, timeout=120, check=True)
    memory = json.loads(out.stdout)["memory_plan"]
    assert memory["total_bytes"] == sum(memory["per_rank_bytes"].values())
    assert set(memory["per_rank_bytes"]) >= {"weights", "activations", "optimizer state"}
    assert memory["total_bytes"] < memory["rank_memory_bytes"]
