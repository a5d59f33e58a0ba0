"""Checkpoints staged and mirrored, on the lab's real object store (SeaweedFS, `ft lab up`): a run
whose shared checkpoints are deleted mid-run (and whose newest S3 copy is corrupt), and one
resubmitted under another shared root, both resume from S3 and end with the weights of an
uninterrupted run (atol 1e-5); a rank killed while a checkpoint is written and another uploaded
loses neither tier (and the model that run trains, only in S3 at first, is fetched once for both
ranks and the restart); a store that is down for most of a run costs it nothing, and the mirror
catches up when it is back."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
import uuid
from pathlib import Path

import pytest

from tests.lab.test_recovery import finished, recipe
from tests.support.s3 import filesystem
from tests.support.slurm import wait_for
from tests.support.tcp_gate import TcpGate
from tests.support.training import assert_same_weights, ft, lab_runs, submit
from toolkit.checkpoint.manifest import tag_for
from toolkit.checkpoint.remote import RemoteTier
from toolkit.lab import chaos

pytest.importorskip("deepspeed", reason="the training stack (ft[train]) is not installed")


@pytest.fixture(scope="module")
def runs(lab) -> Path:
    return lab_runs(lab, "checkpoints")


@pytest.fixture(scope="module")
def s3(lab) -> dict[str, str]:
    assert lab.object_store is not None, "the lab has no object store: run `ft lab up`"
    return lab.object_store.env


@pytest.fixture
def store(s3):
    return filesystem(s3)


def mirror_prefix() -> str:
    return f"s3://ft-checkpoints/tests/{uuid.uuid4().hex[:12]}"


def tiers(run: dict) -> dict:
    try:
        return json.loads((Path(run["run_dir"]) / "checkpoints.json").read_text())
    except (OSError, ValueError):
        return {}


def mirrored_step(run: dict) -> int:
    return ((tiers(run).get("remote") or {}).get("step")) or 0


def rank0_log(run: dict) -> str:
    return (Path(run["run_dir"]) / "logs" / "rank-0.log").read_text()


@pytest.fixture(scope="module")
def deleted_mid_run(tiny_baseline, runs, s3) -> dict:
    """A run whose shared checkpoints are deleted mid-run, and whose newest copy in S3 is corrupt:
    rank 1 stopped (no checkpoint can be published any more), the newest S3 copy flipped, the shared
    copies removed, then the rank killed; the restart inside the job must come from S3."""
    store = filesystem(s3)
    prefix = mirror_prefix()
    document = recipe(runs, "deleted", checkpoint={"s3_mirror": prefix})
    run = submit(document, runs_dir=runs, env=s3)
    wait_for("two checkpoints in S3", lambda: mirrored_step(run) >= 40, timeout=300, interval=0.3)
    stopped = chaos.hang_rank(Path(run["run_dir"]), 1)
    time.sleep(2)  # a publish or an upload already under way finishes
    remote = RemoteTier(prefix, keep_last=2, filesystem=store)
    newest, before = remote.tags()[:2]
    key = f"{prefix.removeprefix('s3://')}/{newest}/mp_rank_00_model_states.pt"
    data = bytearray(store.cat_file(key))
    data[-1] ^= 0xFF
    store.pipe_file(key, bytes(data))
    shutil.rmtree(Path(run["run_dir"]) / "checkpoints")
    os.kill(stopped.pid, signal.SIGKILL)
    finished(run, runs)
    return {"run": run, "prefix": prefix, "newest": newest, "before": before, "recipe": document, "remote": remote}


def test_shared_checkpoints_deleted_mid_run_are_fetched_back_from_s3(tiny_baseline, deleted_mid_run):
    run, prefix, newest, before = (deleted_mid_run[key] for key in ("run", "prefix", "newest", "before"))
    log = rank0_log(run)
    assert f"checkpoint {newest} in the object store ({prefix}) is unusable" in log and "sha256" in log, log[-3000:]
    assert f"fetched checkpoint {before} from the object store" in log, log[-3000:]
    assert f"resumed from checkpoint {before} (from the object store ({prefix})" in log, log[-3000:]
    assert_same_weights(Path(tiny_baseline["run_dir"]), Path(run["run_dir"]), "after resuming from S3")


def test_a_run_resubmitted_under_another_shared_root_continues_from_s3(tiny_baseline, deleted_mid_run, runs, s3):
    """The same recipe (its s3_mirror names the run's checkpoints) resubmitted where none of the first
    run's files are: it continues from S3, from the step before the last (the last one taken away)."""
    remote, prefix = deleted_mid_run["remote"], deleted_mid_run["prefix"]
    last, before_last = remote.tags()[:2]
    assert last == tag_for(120)
    remote.filesystem.rm(f"{prefix.removeprefix('s3://')}/{last}", recursive=True)
    elsewhere = runs.parent / f"elsewhere-{uuid.uuid4().hex[:8]}"  # another shared root
    elsewhere.mkdir()
    second = submit(deleted_mid_run["recipe"], runs_dir=elsewhere, env=s3)
    finished(second, elsewhere)
    log = rank0_log(second)
    assert f"resumed from checkpoint {before_last} (from the object store ({prefix})" in log, log[-3000:]
    assert "step 120/120" in log
    assert_same_weights(Path(tiny_baseline["run_dir"]), Path(second["run_dir"]), "after moving to another root")


@pytest.fixture
def pushed_model(lab, s3, tmp_path):
    """The tiny model every lab run trains, built the same way and pushed by an admin to the lab's
    S3 (`ft model push`) under a new name: no cache holds it yet."""
    from toolkit.train.tiny import ensure_tiny_llama

    name = f"lab-tests/tiny-{uuid.uuid4().hex[:8]}"
    pushed = ft("model", "push", str(ensure_tiny_llama(tmp_path / "models")), "--name", name, env=s3)
    assert pushed.returncode == 0, pushed.stderr
    entry = Path(lab.shared_dir) / "models" / name.replace("/", "--")
    yield name, entry
    for cached in (entry, Path(f"/tmp/ft-model-cache-{os.getuid()}") / entry.name):
        shutil.rmtree(cached, ignore_errors=True)


def test_a_rank_killed_while_checkpoints_are_written_and_uploaded_loses_neither_tier(tiny_baseline, runs, s3, store,
                                                                                     pushed_model, tmp_path):
    """The run also trains a model that only the object store holds: both ranks ask for it at once,
    and it is fetched once, for the run and its restart (the model cache's object-store tier)."""
    name, entry = pushed_model
    prefix = mirror_prefix()
    # Every checkpoint file takes 2 s more to write and to upload: a slow filesystem and store.
    run = submit(recipe(runs, "killed", model={"base": name}, checkpoint={"s3_mirror": prefix},
                        env={"FT_FAULT_SLOW_CHECKPOINT_S": "2"}), runs_dir=runs, env=s3)

    def writing_and_uploading() -> bool:
        remote = tiers(run).get("remote") or {}
        uploading = remote.get("pending") is not None and remote.get("pending") != remote.get("step")
        return uploading and "checkpoint step 40: training paused" in rank0_log(run)
    wait_for("a save being written while another uploads", writing_and_uploading, timeout=300, interval=0.2)
    chaos.kill_rank(Path(run["run_dir"]), 0)  # the writer and the uploader die with it

    finished(run, runs)
    log = rank0_log(run)
    assert "resumed from checkpoint step-00000020 (from the shared filesystem" in log, log[-3000:]
    remote = RemoteTier(prefix, keep_last=2, filesystem=store)
    assert remote.tags()[0] == tag_for(120)
    for tag in remote.tags():  # whatever the kill left half-uploaded was never taken for a checkpoint
        remote.download(tag, tmp_path / tag, None)
    logs = "".join((Path(run["run_dir"]) / "logs" / f"rank-{rank}.log").read_text() for rank in (0, 1))
    assert logs.count("fetched from s3://ft-models") == 1, logs[-3000:]  # once, for both ranks and the restart
    assert (entry / "manifest.json").is_file()
    assert_same_weights(Path(tiny_baseline["run_dir"]), Path(run["run_dir"]), "after a kill mid-write and upload")


def test_a_store_down_for_most_of_a_run_costs_nothing_and_the_mirror_catches_up(lab, runs, s3, store):
    host, port = s3["AWS_ENDPOINT_URL"].removeprefix("http://").split(":")
    gate = TcpGate(host, (host, int(port)))  # closed: the store is down
    prefix = mirror_prefix()
    # The time cadence is Young/Daly's here (every_minutes: auto), the step cadence the recipe's.
    run = submit(recipe(runs, "down", checkpoint={"s3_mirror": prefix, "every_minutes": "auto"}), runs_dir=runs,
                 env={**s3, "AWS_ENDPOINT_URL": gate.url})
    try:
        wait_for("a failing mirror", lambda: (tiers(run).get("remote") or {}).get("error"), timeout=300,
                 interval=0.3)
        status = ft("status", run["run_id"], runs_dir=runs).stdout
        assert "checkpoints: step" in status and "retrying" in status, status
        gate.open()  # the store is back
        wait_for("the mirror to catch up", lambda: mirrored_step(run) >= 20, timeout=180, interval=0.5)
        finished(run, runs)
    finally:
        gate.close()
    last = tag_for(120)
    assert mirrored_step(run) == 120 and tiers(run)["remote"]["error"] is None
    bucket_path = prefix.removeprefix("s3://")
    assert store.exists(f"{bucket_path}/{last}/manifest.json")
    log = rank0_log(run)
    assert "failed" in log and "retrying in" in log
    assert "checkpoint cadence (auto): every" in log and "Young/Daly for a save costing training" in log
