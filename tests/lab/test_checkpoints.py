"""Checkpoints staged and mirrored, on the lab's real object store (SeaweedFS, `ft lab up`): a run
whose shared checkpoints are deleted mid-run, and one resubmitted under another shared root, both
resume from S3 and end with the weights of an uninterrupted run (atol 1e-5); a store that is down for
most of a run costs it nothing, and the mirror catches up when it is back."""

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
from tests.support.slurm import wait_for
from tests.support.tcp_gate import TcpGate
from tests.support.training import assert_same_weights, ft, submit
from toolkit.checkpoint.manifest import tag_for
from toolkit.lab import chaos

pytest.importorskip("deepspeed", reason="the training stack (ft[train]) is not installed")


@pytest.fixture(scope="module")
def runs(lab) -> Path:
    folder = Path(lab.shared_dir) / "tests" / f"checkpoints-{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def s3(lab) -> dict[str, str]:
    assert lab.object_store is not None, "the lab has no object store: run `ft lab up`"
    return lab.object_store.env


@pytest.fixture
def store(s3):
    import s3fs

    return s3fs.S3FileSystem(endpoint_url=s3["AWS_ENDPOINT_URL"], key=s3["AWS_ACCESS_KEY_ID"],
                             secret=s3["AWS_SECRET_ACCESS_KEY"], skip_instance_cache=True)


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


def test_shared_checkpoints_deleted_mid_run_are_fetched_back_from_s3(tiny_baseline, runs, s3):
    prefix = mirror_prefix()
    run = submit(recipe(runs, "deleted", checkpoint={"s3_mirror": prefix}), runs_dir=runs, env=s3)
    wait_for("a checkpoint in S3", lambda: mirrored_step(run) >= 20, timeout=300, interval=0.3)
    # Rank 1 stopped: no checkpoint can be published any more. Then the shared copies go, and the rank.
    stopped = chaos.hang_rank(run["run_id"], 1)
    time.sleep(2)  # a publish already under way finishes
    shutil.rmtree(Path(run["run_dir"]) / "checkpoints")
    os.kill(stopped.pid, signal.SIGKILL)

    finished(run, runs)
    log = rank0_log(run)
    fetched = log.split("fetched checkpoint ", 1)[1].split(" ", 1)[0]
    assert f"resumed from checkpoint {fetched} (from the object store ({prefix})" in log, log[-3000:]
    assert_same_weights(Path(tiny_baseline["run_dir"]), Path(run["run_dir"]), "after resuming from S3")


def test_a_run_resubmitted_under_another_shared_root_continues_from_s3(tiny_baseline, runs, s3, tmp_path_factory):
    prefix = mirror_prefix()
    document = recipe(runs, "moving", checkpoint={"s3_mirror": prefix})
    first = submit(document, runs_dir=runs, env=s3)
    wait_for("a checkpoint in S3", lambda: mirrored_step(first) >= 20, timeout=300, interval=0.3)
    assert ft("cancel", first["run_id"], runs_dir=runs).returncode == 0
    reached = mirrored_step(first)

    elsewhere = Path(runs.parent) / f"elsewhere-{uuid.uuid4().hex[:8]}"  # another shared root: nothing of the first
    elsewhere.mkdir()
    second = submit(document, runs_dir=elsewhere, env=s3)
    finished(second, elsewhere)
    log = rank0_log(second)
    resumed = int(log.split("resumed from checkpoint step-", 1)[1][:8])
    assert resumed >= reached and f"(from the object store ({prefix})" in log, log[-3000:]
    assert_same_weights(Path(tiny_baseline["run_dir"]), Path(second["run_dir"]), "after moving to another root")


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
