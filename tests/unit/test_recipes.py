"""Recipes: located errors with fixes, defaults from model size and method, resource checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from toolkit.recipe.resolve import RecipeError, lora_rank_for, model_size_b, resolve
from toolkit.recipe.schema import Recipe

REPO = Path(__file__).resolve().parents[2]
MINIMAL = {"name": "r", "model": {"base": "meta-llama/Llama-3.1-8B"}, "data": {"train": "/d/train.jsonl"},
           "resources": {"nodes": 2, "gpus_per_node": 8}}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def problems_of(path: Path, cluster: str = "hyperpod") -> list[str]:
    with pytest.raises(RecipeError) as caught:
        resolve(path, cluster)
    return caught.value.problems


def test_typo_is_located_and_the_nearest_key_suggested(tmp_path):
    path = write(tmp_path, "name: r\nmodel:\n  base: x-8B\ndata:\n  train: t.jsonl\ntraining:\n"
                           "  micro_bach: 2\n")
    assert problems_of(path) == [f"{path}:7: training.micro_bach: unknown field; did you mean 'micro_batch'?"]


def test_every_problem_is_reported_at_its_line(tmp_path):
    path = write(tmp_path, "name: r\nmodel:\n  base: x\ndata:\n  train: t.jsonl\n  max_seq_len: 3\n"
                           "method:\n  kind: adapter\n")
    problems = problems_of(path)
    assert len(problems) == 2
    assert problems[0].startswith(f"{path}:6: data.max_seq_len:")
    assert problems[1].startswith(f"{path}:8: method.kind:") and "'lora'" in problems[1]


def test_missing_required_field_is_named(tmp_path):
    path = write(tmp_path, "name: r\nmodel:\n  base: x\n")
    assert problems_of(path) == [f"{path}:1: data: required field is missing"]


def test_invalid_yaml_points_at_the_line(tmp_path):
    path = write(tmp_path, "name: r\nmodel:\n  base: [unclosed\n")
    with pytest.raises(Exception, match=rf"{path}:\d+:\d+: invalid YAML"):
        resolve(path)


def test_secret_in_env_is_refused(tmp_path):
    path = write(tmp_path, yaml.safe_dump(MINIMAL | {"env": {"WANDB_API_KEY": "abc"}}))
    (problem,) = problems_of(path)
    assert "env" in problem and "looks like a secret" in problem


@pytest.mark.parametrize("method,rate", [("lora", 2e-4), ("qlora", 2e-4), ("full", 2e-5)])
def test_learning_rate_defaults_by_method(tmp_path, method, rate):
    path = write(tmp_path, yaml.safe_dump(MINIMAL | {"method": {"kind": method}}))
    resolved = resolve(path, "hyperpod")
    assert resolved.recipe.training.learning_rate == rate
    assert resolved.sources["training.learning_rate"].startswith("default:")


@pytest.mark.parametrize("name,size,rank", [("meta-llama/Llama-3.1-8B", 8, 16), ("Qwen2.5-1.5B", 1.5, 8),
                                            ("llama-70b-chat", 70, 64), ("mistral-small-24B", 24, 32)])
def test_lora_rank_follows_model_size(name, size, rank):
    recipe = Recipe.model_validate(MINIMAL | {"model": {"base": name}})
    assert model_size_b(recipe) == size
    assert lora_rank_for(size) == rank


@pytest.mark.parametrize("name", ["lab-tests/tiny-5b15a4c7", "org/model-ab12b", "gpt2", "bert-base-uncased"])
def test_a_name_without_a_size_of_its_own_has_no_size(name):
    """Digits and a "b" inside a longer token are no size (a pushed model named with a hex suffix was
    taken for 5B, and refused by the memory plan)."""
    assert model_size_b(Recipe.model_validate(MINIMAL | {"model": {"base": name}})) is None


def test_gradient_accumulation_is_derived(tmp_path):
    path = write(tmp_path, yaml.safe_dump(MINIMAL | {"training": {"micro_batch": 2, "global_batch": 128}}))
    resolved = resolve(path, "hyperpod")
    assert resolved.derived.world_size == 16
    assert resolved.derived.gradient_accumulation == 4  # 128 / (2 x 16)


def test_global_batch_not_divisible_is_an_error_with_the_fix(tmp_path):
    path = write(tmp_path, yaml.safe_dump(MINIMAL | {"training": {"micro_batch": 2, "global_batch": 100}}))
    (problem,) = problems_of(path)
    assert "training.global_batch" in problem and "use a multiple of 32" in problem


def test_more_gpus_per_node_than_the_profile_has_is_an_error(tmp_path):
    path = write(tmp_path, yaml.safe_dump(MINIMAL | {"resources": {"nodes": 1, "gpus_per_node": 16}}))
    (problem,) = problems_of(path)
    assert f"{path}:" in problem and "16 GPUs per node, but hyperpod nodes have 8" in problem


def test_explicit_values_win_and_say_so(tmp_path):
    path = write(tmp_path, yaml.safe_dump(MINIMAL | {"training": {"learning_rate": 0.001}}))
    resolved = resolve(path, "hyperpod")
    assert resolved.recipe.training.learning_rate == 0.001
    assert resolved.sources["training.learning_rate"] == "recipe"


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "recipes").glob("*.yaml")))
def test_shipped_recipes_resolve(recipe):
    cluster = "lab" if recipe.startswith("tiny") else "hyperpod"
    resolved = resolve(REPO / "recipes" / recipe, cluster)
    assert resolved.derived.gradient_accumulation >= 1


def test_explain_shows_values_and_their_sources():
    result = subprocess.run([sys.executable, "-m", "toolkit", "recipe", "explain", "--json",
                             str(REPO / "recipes" / "llama3-8b-full-32gpu.yaml"), "--cluster", "oci"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    import json

    explained = json.loads(result.stdout)
    assert explained["values"]["training.learning_rate"] == 2e-5
    assert explained["sources"]["training.learning_rate"] == "default: full fine-tuning"
    assert explained["sources"]["training.zero_stage"] == "recipe"
    assert explained["values"]["derived.world_size"] == 32
    assert explained["values"]["derived.gradient_accumulation"] == 8


def test_bad_recipe_exits_2_and_renders_nothing(tmp_path):
    path = write(tmp_path, "name: r\nmodl:\n  base: x\n")
    out = tmp_path / "job.sbatch"
    result = subprocess.run([sys.executable, "-m", "toolkit", "render", str(path), "-o", str(out)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"{path}:2: modl: unknown field; did you mean 'model'?" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("micro,global_batch,world,expected", [
    (4, 16, 2, 2),   # even: half
    (5, 10, 2, 1),   # odd, one micro batch per rank: halving (2) would not divide 5
    (6, 36, 2, 3),
    (3, 12, 2, 1),
    (1, 8, 2, 1),    # nothing smaller: the same, and the retry fails again with a clear message
    (12, 72, 3, 6),
    (10, 40, 2, 5),
])
def test_the_out_of_memory_micro_batch_keeps_the_global_batch(micro, global_batch, world, expected):
    from toolkit.recipe.run_spec import batch_plan
    from toolkit.recipe.schema import TrainingSpec

    training = TrainingSpec(micro_batch=micro, global_batch=global_batch)
    plan = batch_plan(training, world, out_of_memory_retry=True)
    assert plan.micro_batch == expected
    assert (global_batch // world) % plan.micro_batch == 0 and plan.micro_batch <= max(1, micro // 2)
    assert plan.micro_batch * plan.gradient_accumulation * world == global_batch  # the same global batch
    assert batch_plan(training, world) == type(plan)(micro, global_batch // (micro * world))


@pytest.mark.parametrize("time, lead, seconds", [("90", 600, 5400), ("1-00:00:00", 3600, 86400),
                                                 ("00:20:00", 300, 1200)])
def test_the_lead_before_the_time_limit_is_the_recipes(time, lead, seconds):
    """A large model's save to a slow filesystem takes longer than Slurm's usual 5 minutes."""
    recipe = Recipe.model_validate({"name": "r", "model": {"base": "tiny-llama"}, "data": {"train": "t.jsonl"},
                                    "resources": {"time": time}, "checkpoint": {"before_time_limit": lead}})
    assert recipe.resources.time_limit_seconds() == seconds and recipe.checkpoint.before_time_limit == lead


def test_a_lead_that_leaves_no_time_to_train_is_refused_naming_both_fields():
    with pytest.raises(ValueError) as caught:
        Recipe.model_validate({"name": "r", "model": {"base": "tiny-llama"}, "data": {"train": "t.jsonl"},
                               "resources": {"time": "5"}, "checkpoint": {"before_time_limit": 300}})
    message = str(caught.value)
    assert "checkpoint.before_time_limit (300 s)" in message and "resources.time (5, 300 s)" in message
