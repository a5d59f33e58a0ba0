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


def slice_index() -> int:
    """The lab slice this test process works in: FT_LAB_SLICE, else pytest-xdist's worker number + 1
    (scripts/test.sh runs the lab tests as two workers on a lab of two slices), else the first."""
    if os.environ.get("FT_LAB_SLICE"):
        return int(os.environ["FT_LAB_SLICE"])
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    return int(worker[2:]) + 1 if worker.startswith("gw") else 1


def lab_view(manifest: LabManifest) -> tuple[LabManifest | None, str | None]:
    """The share of the lab this process's tests may use (the whole lab when it has no slices)."""
    index = slice_index()
    if not manifest.slices:
        return (manifest, None) if index == 1 else (None, f"the lab has no slice {index}")
    if index > len(manifest.slices):
        return None, (f"these tests run in slice {index}, and the lab has {len(manifest.slices)}: "
                      f"`ft lab up --nodes {4 * index} --slices {index}`")
    return manifest.slice(index), None


@pytest.fixture(scope="session")
def lab() -> LabManifest:
    """The running lab as this test process may use it (its slice: nodes, partitions, the ft profile
    that maps the tiers to them), healthy (every node of it serving jobs)."""
    manifest = LabManifest.load()
    problem = None
    if os.geteuid() != 0:
        problem = "lab tests run as root"
    elif manifest is None:
        problem = "no lab on this machine: run `ft lab up`"
    else:
        manifest, problem = lab_view(manifest)
        status = collect(manifest) if manifest else None
        if status and not status.healthy:
            problem = "the lab is not healthy: " + "; ".join(status.problems)
    if problem:
        if os.environ.get("FT_REQUIRE_LAB") == "1":
            pytest.fail(problem)
        pytest.skip(problem)
    os.environ["SLURM_CONF"] = manifest.slurm_conf
    # The slice's tiers for everything this process starts: ft's submits (the profile, jobs inherit
    # it) and the tests' own sbatch (tests/support/slurm.py).
    if manifest.slices and manifest.slices[0].index > 1:
        os.environ["FT_SITE_PROFILE"] = manifest.slices[0].profile
    os.environ["FT_TEST_PARTITION"] = manifest.tiers["standard"]
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
def whole_lab(lab) -> LabManifest:
    """Every node and slice: for the tests that change the lab itself (marked `whole_lab`, run alone
    by scripts/test.sh before the lab tests' streams)."""
    return LabManifest.load()


@pytest.fixture
def heal_lab(lab):
    """Bring crashed nodes back after the test, through `ft lab up` as a user would (a node a job
    marked down returns by itself once its slurmd registers again: ReturnToService=2)."""
    from tests.support.slurm import heal

    yield
    heal(lab)


def pytest_configure(config):
    """Before any fixture runs: sockets reach only loopback and the lab, and processes the tests
    start send S3 traffic to loopback unless a test names the lab's own S3 server."""
    from tests.support import network_guard

    network_guard.install()


@pytest.fixture(autouse=True)
def no_process_wide_s3_config():
    """ft makes each filesystem with its own options (toolkit/storage/object_store.py): nothing a test
    runs leaves an endpoint in fsspec's process-wide configuration for the next one to inherit."""
    yield
    from tests.support import network_guard

    network_guard.assert_no_process_wide_s3_config()
