"""Hostile and careless recipe files: each ends in a located error, never a hang, a crash or a
silently different recipe (issue: no input runs code, hangs or crashes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.base.errors import FtError
from toolkit.recipe.resolve import resolve

BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
    f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
    for i in range(9))

CASES = {
    "alias bomb": (lambda p: p.write_text("name: bomb\n" + BOMB), "expands to more than"),
    "deep flow nesting": (lambda p: p.write_text("name: x\nmodel: " + "[" * 100_000 + "]" * 100_000 + "\n"),
                          "nested"),
    "deep block nesting": (lambda p: p.write_text("name: x\nmodel:\n  " + "- " * 50_000 + "x\n"), "nested"),
    "duplicate key": (lambda p: p.write_text("name: a\nmodel: {base: tiny-llama}\nname: b\n"),
                      "key 'name' appears twice (lines 1 and 3)"),
    "a folder": (lambda p: p.mkdir(), "is a folder"),
    "a FIFO": (lambda p: os.mkfifo(p), "not a regular file"),
    "too large": (lambda p: p.write_text("name: x\n# " + "x" * (2 << 20) + "\n"), "larger than 1 MiB"),
    "symlink loop": (lambda p: p.symlink_to(p), "cannot be read"),
    "not UTF-8": (lambda p: p.write_bytes(b"name: \xff\xfe\n"), "not UTF-8 text"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_recipe_is_a_located_error(tmp_path, case):
    write, expected = CASES[case]
    recipe = tmp_path / "recipe.yaml"
    write(recipe)
    with pytest.raises(FtError) as raised:
        resolve(recipe, "lab")
    assert expected in str(raised.value) and str(recipe) in str(raised.value)


@pytest.mark.timeout(60)
def test_the_cli_says_so_in_one_line_and_exits_2(tmp_path):
    recipe = tmp_path / "deep.yaml"
    recipe.write_text("name: x\nmodel: " + "[" * 100_000 + "]" * 100_000 + "\n")
    result = subprocess.run([sys.executable, "-m", "toolkit", "recipe", "explain", str(recipe)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"{recipe}" in result.stderr and "nested" in result.stderr


def test_a_hostile_cluster_profile_is_a_located_error(tmp_path, monkeypatch):
    clusters = tmp_path / "clusters.yaml"
    clusters.write_text("mine: &m {extends: lab}\n" + BOMB)
    monkeypatch.setenv("FT_CLUSTERS_FILE", str(clusters))
    with pytest.raises(FtError) as raised:
        resolve(Path(__file__).resolve().parents[2] / "recipes" / "tiny-lora-sft.yaml", "lab")
    assert str(clusters) in str(raised.value) and "expands to more than" in str(raised.value)


@pytest.mark.parametrize("time", ["٠٤:٠٠:٠٠", "０4:00:00", "90\n", "04:00:00 "])
def test_a_time_limit_in_other_digits_or_with_trailing_characters_is_refused(tmp_path, time):
    import yaml

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "model": {"base": "tiny-llama"},
                                      "data": {"train": "train.jsonl"}, "resources": {"time": time}}))
    with pytest.raises(FtError, match="resources.time"):
        resolve(recipe, "lab")


def test_a_percent_sign_in_the_run_directory_is_refused_before_sbatch_expands_it(tmp_path, monkeypatch):
    import yaml

    from toolkit.render.sbatch import RenderError, RunPlacement, render

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny-lora-sft.yaml"
    clusters = tmp_path / "clusters.yaml"
    clusters.write_text(yaml.safe_dump({"pct": {"extends": "lab", "shared_root": str(tmp_path / "a%jb")}}))
    monkeypatch.setenv("FT_CLUSTERS_FILE", str(clusters))
    with pytest.raises(FtError, match="'%'"):  # refused with the profile, before any rendering
        resolve(recipe, "pct")
    monkeypatch.setenv("FT_CLUSTERS_FILE", str(tmp_path / "none.yaml"))
    resolved = resolve(recipe, "lab")
    with pytest.raises(RenderError, match="'%'"):  # and a run directory given directly
        render(resolved, RunPlacement("r1", str(tmp_path / "a%jb" / "runs" / "r1")))


@pytest.mark.parametrize("name,value,expected", [
    ("FT_RUN_DIR", "/elsewhere", "a recipe cannot change it"),
    ("SLURM_JOB_ID", "1", "a recipe cannot change it"),
    ("SHELLOPTS", "xtrace", "a recipe cannot change it"),
    ("LD_PRELOAD", "/tmp/x.so", "a recipe cannot change it"),
    ("HF_TOKEN", "x", "looks like a secret"),
    ("MY_NOTE", "a\0b", "NUL character"),
    ("MY_NOTE", "x" * (130 * 1024), "longer than 128 KiB"),
    ("MY_NOTE", "hf_" + "a1" * 17, "looks like a secret"),
    ("DATA_URL", "https://user:hunter2@example.org/x", "looks like a secret"),
])
def test_recipe_env_entries_that_would_break_or_leak_are_refused(tmp_path, name, value, expected):
    import yaml

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "model": {"base": "tiny-llama"}, "data": {"train": "t.jsonl"},
                                      "env": {name: value}}))
    with pytest.raises(FtError, match=expected):
        resolve(recipe, "lab")


@pytest.mark.parametrize("name", ["TOKENIZERS_PARALLELISM", "FT_FAULT_NAN_AT_STEP", "NCCL_DEBUG"])
def test_ordinary_env_entries_are_accepted(tmp_path, name):
    import yaml

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "model": {"base": "tiny-llama"}, "data": {"train": "t.jsonl"},
                                      "env": {name: "1"}}))
    assert resolve(recipe, "lab").recipe.env == {name: "1"}
