"""Fixtures the lab's training tests share."""

from __future__ import annotations

import pytest

from tests.support.training import TINY, ft, lab_runs, submit, wait_done


@pytest.fixture(scope="session")
def tiny_baseline(lab) -> dict:
    """One uninterrupted 2-node run of the tiny recipe: what every interrupted run must end equal to."""
    pytest.importorskip("deepspeed", reason="the training stack (ft[train]) is not installed")
    runs = lab_runs(lab, "baseline")
    run = submit(TINY, runs_dir=runs, env={"FT_METRICS_FINAL_WAIT_S": "20"})  # monitoring's tests read it
    assert wait_done(run["run_id"], runs_dir=runs) == "COMPLETED", \
        ft("logs", run["run_id"], "--rank", "0", runs_dir=runs).stdout[-3000:]
    return run


@pytest.fixture(scope="session", autouse=True)
def early_wheelhouse(request, lab):
    """The user-setup test's wheelhouse is a minute of pip that waits on no Slurm job: begun beside
    the session's first tests when that test is in the session."""
    if any(item.nodeid.startswith("tests/lab/test_user_setup.py") for item in request.session.items):
        from tests.support.wheelhouse import begin, folder_of

        begin(folder_of(lab.shared_dir))
    yield
