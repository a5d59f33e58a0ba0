"""A job records itself in its run's record as it starts (toolkit/runs/register.py): once per job,
whoever writes the record first, and from the run spec alone when the script was submitted with
plain sbatch."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.run_specs import run_spec, write_run_spec
from toolkit.runs.register import register
from toolkit.runs.store import JobRecord, RunRecord, RunStore


def test_a_run_without_a_record_is_adopted_and_a_requeued_job_added_once(tmp_path):
    run_dir = tmp_path / "runs" / "by-hand"
    run_dir.mkdir(parents=True)
    write_run_spec(run_dir, run_spec())

    register(run_dir, "by-hand", "41", "train")
    record = register(run_dir, "by-hand", "41", "train")  # the same job, requeued

    loaded = RunStore(tmp_path / "runs").load("by-hand")
    assert loaded == record
    assert (loaded.recipe_name, loaded.mode, [job.job_id for job in loaded.jobs]) == ("unit", "train", ["41"])


def test_the_job_and_ft_submit_recording_at_once_lose_neither(tmp_path):
    store = RunStore(tmp_path / "runs")
    store.create_run_dir("r1")
    store.save(RunRecord("r1", "unit", "/r.yaml", "lab", "train", time.time()))
    write_run_spec(store.run_dir("r1"), run_spec())
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda n: store.add_job("r1", JobRecord(str(n), time.time())), range(40)))
    assert sorted(int(job.job_id) for job in store.load("r1").jobs) == list(range(40))


def test_a_failure_to_record_never_stops_the_job(tmp_path):
    run_dir = tmp_path / "runs" / "r2"
    run_dir.mkdir(parents=True)  # no spec, no record: nothing to adopt from
    env = dict(os.environ, FT_RUN_DIR=str(run_dir), FT_RUN_ID="r2", SLURM_JOB_ID="7")
    result = subprocess.run([sys.executable, "-m", "toolkit.runs.register"], env=env, capture_output=True, text=True)
    assert result.returncode == 1
    assert "could not record job 7" in result.stderr
    assert not (run_dir / "run.json").exists()


def test_a_failure_to_record_of_a_kind_nobody_foresaw_never_stops_the_job_either(tmp_path, monkeypatch, capsys):
    """register.py's blind except: not only the store's OSError or a missing spec; whatever the record's
    write raises, the job script is told (exit 1, said on stderr) and goes on (narrowed to OSError,
    this test fails: checked)."""
    from toolkit.runs import register as register_module

    class Unforeseen(Exception):
        pass

    def failing(*args, **kwargs):
        raise Unforeseen("the run store broke in a way nobody foresaw")

    run_dir = tmp_path / "runs" / "r4"
    run_dir.mkdir(parents=True)
    write_run_spec(run_dir, run_spec())
    for name, value in {"FT_RUN_DIR": str(run_dir), "FT_RUN_ID": "r4", "SLURM_JOB_ID": "9"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(register_module, "register", failing)
    assert register_module.main() == 1
    assert "could not record job 9 in the run's record: the run store broke in a way nobody foresaw" in \
        capsys.readouterr().err


def test_a_planted_lock_or_a_stuck_holder_never_hangs_the_job(tmp_path, monkeypatch):
    import fcntl

    from toolkit.runs import store as store_module

    store = RunStore(tmp_path / "runs")
    store.create_run_dir("r3")
    store.save(RunRecord("r3", "unit", "/r.yaml", "lab", "train", time.time()))
    lock = store.run_dir("r3") / ".run.lock"
    os.mkfifo(lock)  # a FIFO in the lock's place: opening it must not block
    with pytest.raises(OSError, match="not a lock file"):
        store.add_job("r3", JobRecord("1", time.time()))
    lock.unlink()
    lock.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(OSError):
        store.add_job("r3", JobRecord("1", time.time()))
    assert not (tmp_path / "elsewhere").exists()  # nothing made where the symlink points
    lock.unlink()

    monkeypatch.setattr(store_module, "LOCK_WAIT_S", 0.5)
    with open(lock, "a") as holder:  # another process holding the lock and never letting go
        fcntl.flock(holder, fcntl.LOCK_EX)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            store.add_job("r3", JobRecord("1", time.time()))
        assert time.monotonic() - started < 5
