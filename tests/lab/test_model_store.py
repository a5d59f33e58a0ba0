"""The model cache's object-store tier on the lab: a model an admin pushed to the lab's S3 (`ft model
push`) and that no cache holds yet is fetched once for a two-node run whose ranks all ask for it at
once, and trains exactly as the same model built locally did."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from tests.lab.test_recovery import finished, recipe
from tests.support.training import assert_same_weights, ft, submit

pytest.importorskip("deepspeed", reason="the training stack (ft[train]) is not installed")


def test_a_pushed_model_is_fetched_once_for_a_two_node_run(lab, tiny_baseline, tmp_path):
    from toolkit.train.tiny import ensure_tiny_llama

    s3 = lab.object_store.env
    name = f"lab-tests/tiny-{uuid.uuid4().hex[:8]}"
    entry = Path(lab.shared_dir) / "models" / name.replace("/", "--")
    folder = ensure_tiny_llama(tmp_path / "models")  # the model the baseline trained, built the same way
    pushed = ft("model", "push", str(folder), "--name", name, env=s3)
    assert pushed.returncode == 0, pushed.stderr
    runs = Path(lab.shared_dir) / "tests" / f"models-{os.getpid()}"
    runs.mkdir(parents=True, exist_ok=True)
    try:
        run = submit(recipe(runs, "pushed", model={"base": name}), runs_dir=runs, env=s3)
        finished(run, runs)
        logs = [(Path(run["run_dir"]) / "logs" / f"rank-{rank}.log").read_text() for rank in (0, 1)]
        fetched = sum(log.count("fetched from s3://ft-models") for log in logs)
        assert fetched == 1, logs  # one download for the cluster; the other rank found it whole
        assert (entry / "manifest.json").is_file()
        assert_same_weights(Path(tiny_baseline["run_dir"]), Path(run["run_dir"]), "from the model fetched from S3")
    finally:
        shutil.rmtree(entry, ignore_errors=True)
        shutil.rmtree(Path(f"/tmp/ft-model-cache-{os.getuid()}") / entry.name, ignore_errors=True)
