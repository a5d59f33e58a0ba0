"""Training runs on the lab through `ft`, as a user would start and watch them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.slurm import wait_for

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny-lora-sft.yaml"
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY"}


def tiny_recipe() -> dict:
    """The tiny recipe as a document to change and write anywhere: its data files (train, eval,
    golden) named by absolute paths, which a recipe written elsewhere would otherwise lose."""
    import yaml

    document = yaml.safe_load(TINY.read_text())
    for section, field in (("data", "train"), ("data", "eval"), ("eval", "golden")):
        if document.get(section, {}).get(field):
            document[section][field] = str(TINY.parent / document[section][field])
    return document


def lab_runs(lab, purpose: str) -> Path:
    """A runs folder of this test session's own on the lab's shared filesystem, seen by every node."""
    folder = Path(lab.shared_dir) / "tests" / f"{purpose}-{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def ft(*args: str, runs_dir: Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`ft ARGS` as a user runs it; `env`: variables added to this process's (the job inherits them)."""
    environment = dict(os.environ, **(env or {}), **({"FT_RUNS_DIR": str(runs_dir)} if runs_dir else {}))
    return subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, timeout=120,
                          env=environment)


def submit(recipe: Path, runs_dir: Path | None = None, env: dict[str, str] | None = None) -> dict:
    result = ft("submit", "--json", str(recipe), runs_dir=runs_dir, env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def state(run_id: str, runs_dir: Path | None = None) -> str:
    return json.loads(ft("status", run_id, "--json", runs_dir=runs_dir).stdout)["state"]


def wait_done(run_id: str, timeout: float = 300, runs_dir: Path | None = None) -> str:
    return wait_for(f"run {run_id} to finish",
                    lambda: (lambda s: s if s in ENDED else None)(state(run_id, runs_dir)), timeout=timeout,
                    interval=2)


def adapter_tensors(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "output" / "adapter_model.safetensors")


def assert_same_weights(expected_run: Path, actual_run: Path, why: str = "") -> None:
    """The adapters of two runs agree within 1e-5: an interrupted run lost nothing."""
    import torch

    expected, actual = adapter_tensors(expected_run), adapter_tensors(actual_run)
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.allclose(expected[name], actual[name], atol=1e-5), f"{name} differs {why}"
