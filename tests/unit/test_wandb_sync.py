"""`ft sync RUN` pushes a run's offline W&B logs (written by ft's own Tracker, as on compute nodes
without internet) through the real wandb client. No W&B server can run here, and the tests reach
nothing off the machine: the server is a stand-in on loopback (tests/support/fake_wandb.py) that
answers the client's requests with the smallest answers it accepts and records them."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.fake_wandb import FakeWandb
from tests.support.run_specs import run_spec, write_run_spec
from toolkit.runs.layout import RunLayout
from toolkit.train.step_signals import StepRecord
from toolkit.train.tracking import Tracker

pytest.importorskip("wandb", reason="W&B's client is part of ft[train]")

KEY = "k" * 40


def offline_run(runs, run_id: str, adapter: dict[str, bytes] | None = None) -> None:
    run_dir = runs / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text(json.dumps({
        "run_id": run_id, "recipe_name": "unit", "recipe_path": "/r.yaml", "cluster": "lab", "mode": "train",
        "created": time.time(), "idempotency_key": None, "jobs": [{"job_id": "7", "submitted": time.time()}]}))
    spec = run_spec()
    recipe = spec.recipe.model_validate(spec.recipe.model_dump(mode="json") | {
        "tracking": {"wandb": {"mode": "offline", "project": "proj-x"}}})
    write_run_spec(run_dir, spec.model_copy(update={"recipe": recipe}))
    now = time.time()
    events = [{"time": now - 60, "job": "7", "event": "start", "start": 1, "nodes": ["n1", "n2"]},
              {"time": now - 30, "job": "7", "event": "node_lost", "node": "n2", "reason": "no heartbeat for 10 s"},
              {"time": now - 20, "job": "7", "event": "start", "start": 2, "nodes": ["n1", "n3"]}]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    tracker = Tracker(RunLayout(run_dir), recipe, rank=0)
    tracker.log([StepRecord(step, now + step, 1e-4, 100 * step, 3.0 / step, None) for step in range(1, 6)])
    if adapter is not None:  # as the worker does once the output is written
        output = RunLayout(run_dir).output
        output.mkdir()
        for name, content in adapter.items():
            (output / name).write_bytes(content)
        tracker.artifact(output)
    tracker.finish()


def ft(*args: str, env: dict, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, timeout=180,
                          env={**os.environ, **env, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}, cwd=cwd)


def test_an_offline_run_is_pushed_once_with_its_recipe_and_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("FT_RUN_ID", "run-1")  # the Tracker names the W&B run after ft's
    monkeypatch.setenv("WANDB_X_DISABLE_UPDATE_CHECK", "true")
    offline_run(tmp_path, "run-1")
    fake = FakeWandb()
    try:
        env = {"FT_RUNS_DIR": str(tmp_path), "WANDB_BASE_URL": fake.url, "WANDB_API_KEY": KEY,
               "WANDB_X_DISABLE_UPDATE_CHECK": "true"}
        pushed = ft("sync", "run-1", env=env)
        assert pushed.returncode == 0, pushed.stdout + pushed.stderr
        assert "1 offline W&B log pushed" in pushed.stdout
        (upsert, *_) = fake.upserts()
        assert upsert["name"] == "run-1" and upsert["project"] == "proj-x"  # the recipe's project
        assert json.loads(upsert["config"])["name"]["value"] == "unit"  # the resolved recipe is the run's config
        losses = {row["train/step"]: row["train/loss"] for row in fake.streamed("wandb-history.jsonl")
                  if "train/loss" in row}
        assert losses == {step: pytest.approx(3.0 / step) for step in range(1, 6)}
        # The restarts and each fault, in the run's summary.
        summary = fake.streamed("wandb-summary.json")[-1]
        assert summary["ft/restarts"] == 1
        assert [(f["event"], f["node"], f["why"]) for f in summary["ft/faults"]] == [
            ("node_lost", "n2", "no heartbeat for 10 s")]
        seen = len(fake.requests)
        again = ft("sync", "run-1", env=env)
        assert again.returncode == 0 and "synced already" in again.stdout and len(fake.requests) == seen
        upserted = len(fake.upserts())
        forced = ft("sync", "run-1", "--all", env=env)  # pushed again, and said so only because it was
        assert forced.returncode == 0 and "1 offline W&B log pushed" in forced.stdout, forced.stdout + forced.stderr
        assert len(fake.upserts()) > upserted
    finally:
        fake.close()
    assert KEY not in pushed.stdout + pushed.stderr + again.stdout + again.stderr + forced.stdout + forced.stderr


def test_the_adapter_is_pushed_as_an_artifact_named_for_what_it_is(tmp_path, monkeypatch):
    """The adapter, logged offline on the compute node, reaches W&B through `ft sync` from the run's
    output folder (referenced, not copied to a staging folder in the home of whoever trained)."""
    import hashlib

    monkeypatch.setenv("FT_RUN_ID", "run-3")
    monkeypatch.setenv("WANDB_X_DISABLE_UPDATE_CHECK", "true")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # where wandb would stage a copy
    adapter = {"adapter_config.json": b'{"r": 8, "lora_alpha": 16}',
               "adapter_model.safetensors": bytes(range(256)) * 40}
    offline_run(tmp_path, "run-3", adapter=adapter)
    assert not list((tmp_path / "home").rglob("*.safetensors"))  # nothing staged in $HOME
    fake = FakeWandb()
    try:
        pushed = ft("sync", "run-3", env={"FT_RUNS_DIR": str(tmp_path), "WANDB_BASE_URL": fake.url,
                                          "WANDB_API_KEY": KEY, "WANDB_X_DISABLE_UPDATE_CHECK": "true"})
    finally:
        fake.close()
    assert pushed.returncode == 0, pushed.stdout + pushed.stderr
    (created,) = [r["body"]["variables"]["input"] for r in fake.requests
                  if r["path"].endswith("/graphql") and "createArtifact(" in r["body"].get("query", "")]
    assert created["artifactCollectionName"] == "run-3-lora-adapter" and created["artifactTypeName"] == "model"
    assert json.loads(created["metadata"]) == {"method": "lora", "base_model": run_spec().recipe.model.base}
    assert {name: fake.uploads[f"/upload/artifact/{name}"] for name in adapter} == adapter  # every byte
    manifest = json.loads(fake.uploads["/upload/manifest"])["contents"]
    assert set(manifest) == set(adapter)
    for name, content in adapter.items():
        assert manifest[name]["size"] == len(content)
        assert base64.b64decode(manifest[name]["digest"]) == hashlib.md5(content).digest()
    assert any(r["path"].endswith("/graphql") and "commitArtifact(" in r["body"].get("query", "")
               for r in fake.requests)  # the version committed, not left pending


def test_a_refused_push_is_an_error_and_is_tried_again_next_time(tmp_path, monkeypatch):
    """wandb exits 0 when the server refuses a run (a wrong key): ft reads wandb's own mark."""
    monkeypatch.setenv("FT_RUN_ID", "run-2")
    offline_run(tmp_path, "run-2")
    fake = FakeWandb(refuse=True)
    try:
        env = {"FT_RUNS_DIR": str(tmp_path), "WANDB_BASE_URL": fake.url, "WANDB_API_KEY": KEY,
               "WANDB_X_DISABLE_UPDATE_CHECK": "true"}
        here = tmp_path / "here"
        here.mkdir()
        refused = ft("sync", "run-2", env=env, cwd=here)
    finally:
        fake.close()
    assert refused.returncode != 0 and "W&B did not take 1 of run run-2's 1 offline logs" in refused.stderr
    assert "pushed" not in refused.stdout
    assert list(here.iterdir()) == []  # wandb's own logs go to the run's folder, not where ft was run


def test_a_run_that_logged_nothing_offline_says_so(tmp_path):
    (tmp_path / "r0").mkdir()
    (tmp_path / "r0" / "run.json").write_text(json.dumps({
        "run_id": "r0", "recipe_name": "unit", "recipe_path": "/r.yaml", "cluster": "lab", "mode": "train",
        "created": 1.0, "idempotency_key": None, "jobs": []}))
    done = ft("sync", "r0", env={"FT_RUNS_DIR": str(tmp_path)})
    assert done.returncode == 0 and "no offline W&B log" in done.stdout
