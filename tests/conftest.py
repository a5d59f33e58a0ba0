"""Shared fixtures. Lab tests need the local lab up (`ft lab up`); they skip with a reason when it
is not, except under FT_REQUIRE_LAB=1 (CI), where a missing lab fails them instead."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from toolkit.lab.manifest import LabManifest
from toolkit.lab.status import collect

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/lab/" in str(item.fspath):
            item.add_marker(pytest.mark.lab)


@pytest.fixture(scope="session")
def lab() -> LabManifest:
    """The running lab, healthy (every node serving jobs)."""
    manifest = LabManifest.load()
    problem = None
    if os.geteuid() != 0:
        problem = "lab tests run as root"
    elif manifest is None:
        problem = "no lab on this machine: run `ft lab up`"
    else:
        status = collect(manifest)
        if not status.healthy:
            problem = "the lab is not healthy: " + "; ".join(status.problems)
    if problem:
        if os.environ.get("FT_REQUIRE_LAB") == "1":
            pytest.fail(problem)
        pytest.skip(problem)
    os.environ["SLURM_CONF"] = manifest.slurm_conf
    # A run's watchdog waits up to a scrape interval at its end for Prometheus's last look: worth it
    # to a user, not to a test of something else (seconds for each of some forty runs; jobs inherit
    # this). The monitoring tests' run keeps it (tiny_baseline).
    os.environ.setdefault("FT_METRICS_FINAL_WAIT_S", "0")
    return manifest


@pytest.fixture
def shared_tmp(lab) -> Path:
    """A fresh folder on the lab's shared filesystem, seen by every node."""
    path = Path(lab.shared_dir) / "tests" / uuid.uuid4().hex[:12]
    path.mkdir(parents=True)
    return path


@pytest.fixture
def heal_lab(lab):
    """Bring crashed nodes back after the test, through `ft lab up` as a user would (a node a job
    marked down returns by itself once its slurmd registers again: ReturnToService=2)."""
    from toolkit.lab import lifecycle

    yield
    outcome = lifecycle.up()
    assert outcome.status.healthy, outcome.status.problems


def pytest_configure(config):
    """Before any fixture runs: sockets reach only loopback and the lab, and processes the tests
    start send S3 traffic to loopback unless a test names the lab's own S3 server."""
    from tests.support import network_guard

    network_guard.install()


@pytest.fixture(autouse=True)
def s3_config_per_test(monkeypatch):
    from tests.support import network_guard

    network_guard.isolate_s3_config(monkeypatch)
