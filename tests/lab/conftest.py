"""Fixtures the lab's training tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import streams
from tests.support.training import TINY, ft, lab_runs, submit, wait_done

# The lab's test files, longest first (as measured in a run of two streams): pytest-xdist hands each
# stream a whole file as it becomes free, so starting with the long ones ends the streams together.
# A file not named here runs after these.
LONGEST_FIRST = ("test_recovery.py", "test_training.py", "test_user_setup.py", "test_multi_user.py",
                 "test_checkpoints.py", "test_submit.py", "test_monitoring.py")


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        name = Path(str(item.fspath)).name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: each file's tests keep their order


@pytest.fixture(scope="session")
def tiny_baseline(lab) -> dict:
    """One uninterrupted 2-node run of the tiny recipe: what every interrupted run must end equal to
    (one for the whole test run, whichever stream asks first)."""
    pytest.importorskip("deepspeed", reason="the training stack (ft[train]) is not installed")

    def run_it() -> dict:
        runs = lab_runs(lab, "baseline")
        run = submit(TINY, runs_dir=runs, env={"FT_METRICS_FINAL_WAIT_S": "20"})  # monitoring's tests read it
        assert wait_done(run["run_id"], runs_dir=runs) == "COMPLETED", \
            ft("logs", run["run_id"], "--rank", "0", runs_dir=runs).stdout[-3000:]
        return run

    return streams.once(Path(lab.shared_dir) / "tests", "tiny-baseline", run_it)


@pytest.fixture(scope="session", autouse=True)
def early_wheelhouse(request, lab):
    """The user-setup test's wheelhouse is a minute of pip that waits on no Slurm job: begun beside
    the session's first tests when that test is in the session."""
    if any(item.nodeid.startswith("tests/lab/test_user_setup.py") for item in request.session.items):
        from tests.support.wheelhouse import begin, folder_of

        begin(folder_of(lab.shared_dir))
    yield
