"""The SlurmClient contract, run against every backend that can run here, and its failure modes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.slurm import sbatch, wait_for, write_script
from toolkit.slurm import commands
from toolkit.slurm.client import CliSlurmClient, PyslurmClient, pyslurm_unavailable_reason
from toolkit.slurm.commands import SlurmUnavailable

pytestmark = pytest.mark.slurm_matrix  # what ft asks of Slurm: run on every release


def backends():
    yield pytest.param(CliSlurmClient, id="cli")
    reason = pyslurm_unavailable_reason(CliSlurmClient().version())
    yield pytest.param(PyslurmClient, id="pyslurm", marks=pytest.mark.skipif(reason is not None, reason=str(reason)))


@pytest.fixture(params=list(backends()))
def client(request, lab):
    return request.param()


def test_reports_the_running_slurm_version(client):
    major, minor, _ = client.version()
    assert (major, minor) >= (20, 11)


def test_follows_a_job_from_queue_to_completion(client, shared_tmp):
    script = write_script(shared_tmp / "short.sh", "sleep 3\n")
    job_id = sbatch(script, "--nodes=1", f"--output={shared_tmp}/out")

    first = wait_for("the job to be seen", lambda: client.job(job_id), timeout=30)
    assert first.state in {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "COMPLETED"}
    done = wait_for("the job to complete", lambda: (lambda j: j if j and j.finished else None)(client.job(job_id)),
                    timeout=60)
    assert done.state == "COMPLETED"


def test_cancel(client, shared_tmp):
    script = write_script(shared_tmp / "long.sh", "sleep 300\n")
    job_id = sbatch(script, "--nodes=1", f"--output={shared_tmp}/out")
    wait_for("the job to run", lambda: (client.job(job_id) or None) and client.job(job_id).state == "RUNNING",
             timeout=30)
    client.cancel([job_id])
    cancelled = wait_for("the job to be cancelled",
                         lambda: (lambda j: j if j and j.state == "CANCELLED" else None)(client.job(job_id)),
                         timeout=30)
    assert cancelled.finished


def test_unknown_job_is_none(client):
    assert client.job("999999") is None


def test_unreachable_controller_is_a_clear_error_within_the_timeout(lab, tmp_path, monkeypatch):
    # A controller address on the lab bridge where nothing listens: the traffic stays on this machine.
    conf = Path(lab.slurm_conf).read_text()
    conf = conf.replace(f"SlurmctldHost={lab.controller_name}({lab.controller_address})",
                        "SlurmctldHost=ctl(10.213.7.250)")
    (tmp_path / "slurm.conf").write_text(conf)
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))

    started = time.monotonic()
    with pytest.raises(SlurmUnavailable) as raised:
        commands.run(["squeue"], timeout=3)
    assert time.monotonic() - started < 30  # bounded by the timeout, not by Slurm's retries
    assert "did not answer within 3 s" in raised.value.message or "unreachable" in raised.value.message


def test_pyslurm_backend_says_why_it_is_not_used_here():
    reason = pyslurm_unavailable_reason(CliSlurmClient().version())
    try:
        import pyslurm  # noqa: F401
    except ImportError:
        assert reason and "not installed" in reason
