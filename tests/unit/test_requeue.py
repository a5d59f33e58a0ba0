"""The helper that lifts Slurm's requeue hold (toolkit/watch/requeue.py).

Slurm's tools are stand-ins here (a scripted squeue and a recording scontrol on PATH): the
unit tests must not touch the lab's jobs. The lab's no-spare test runs the real thing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from toolkit.slurm.client import JobInfo
from toolkit.watch import requeue

FAKE_TOOLS = {
    # The job's state is whatever the test wrote into $FAKE_STATE ("STATE RESTARTS").
    "scontrol": 'if [ "$1 $2" = "show job" ]; then read -r state restarts < "$FAKE_STATE"; '
                'echo "JobId=41 JobName=x JobState=$state Reason=None Restarts=${restarts:-0} BatchFlag=1"; '
                'elif [ "$1" = listpids ]; then echo "PID JOBID STEPID LOCALID GLOBALID"; '  # nothing else here
                'else echo "$*" >> "$FAKE_CALLS"; fi',
}


def fake_slurm_tools(tmp_path: Path, monkeypatch, state: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in FAKE_TOOLS.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    (tmp_path / "state").write_text(state)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_STATE", str(tmp_path / "state"))
    monkeypatch.setenv("FAKE_CALLS", str(tmp_path / "calls"))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    return tmp_path / "calls"


class ScriptedSlurm:
    def __init__(self, states: list[str | None], accept: bool = True):
        self.states, self.accept, self.started_after = states, accept, []

    def job_brief(self, job_id: str) -> JobInfo | None:
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        if state is None:
            return None
        name, _, restarts = state.partition(" ")
        return JobInfo(job_id, name, "scontrol", restarts=int(restarts or 0))

    def start_after(self, job_id: str, seconds: int) -> bool:
        self.started_after.append((job_id, seconds))
        return self.accept


def test_the_begin_time_is_kept_ahead_until_the_starter_is_gone(monkeypatch):
    monkeypatch.setattr(requeue, "POLL_S", 0.01)
    slurm = ScriptedSlurm(["RUNNING", "RUNNING", "PENDING"])
    starter = iter([True, True, False])
    assert requeue.lift_hold(slurm, "41", after=2, starter_alive=lambda: next(starter))
    assert slurm.started_after == [("41", 2)] * 3  # the last one once the helper was the job's last process


def test_a_requeued_job_still_completing_counts_as_requeued_once_its_restarts_went_up(monkeypatch):
    """Where the helper is one of the job's processes (proctrack/cgroup), the job stays COMPLETING
    (pending underneath) until the helper itself is gone: it must act then, but not on a job that
    is only ending."""
    monkeypatch.setattr(requeue, "POLL_S", 0.01)
    slurm = ScriptedSlurm(["RUNNING 0", "COMPLETING 1"])
    assert requeue.lift_hold(slurm, "41", after=1, starter_alive=lambda: False, restarts=0)
    assert slurm.started_after == [("41", 1)]
    ending = ScriptedSlurm(["COMPLETING 0", "COMPLETED 0"])
    assert not requeue.lift_hold(ending, "41", after=1, starter_alive=lambda: False, restarts=0)
    assert ending.started_after == []


def test_slurm_too_slow_to_answer_is_asked_again(monkeypatch):
    from toolkit.slurm.commands import SlurmUnavailable

    monkeypatch.setattr(requeue, "POLL_S", 0.01)
    slurm = ScriptedSlurm(["PENDING"])
    answers = iter([SlurmUnavailable("scontrol show job 41 did not answer within 20 s")])

    def slow_then_fine(job_id):
        for problem in answers:
            raise problem
        return ScriptedSlurm.job_brief(slurm, job_id)

    slurm.job_brief = slow_then_fine
    assert requeue.lift_hold(slurm, "41", after=1, starter_alive=lambda: False)
    assert requeue.retried(lambda: (_ for _ in ()).throw(SlurmUnavailable("slow")), "requeueing", tries=2) is False


def test_a_job_started_again_ends_the_helper(monkeypatch):
    """Where the helper was not one of the job's processes (it outlived a tracking that lost it)."""
    monkeypatch.setattr(requeue, "POLL_S", 0.01)
    slurm = ScriptedSlurm(["PENDING", "PENDING", "RUNNING"])
    assert requeue.lift_hold(slurm, "41", after=2, starter_alive=lambda: True)
    assert len(slurm.started_after) == 2


def test_a_job_that_ends_instead_is_left_alone(monkeypatch):
    monkeypatch.setattr(requeue, "POLL_S", 0.01)
    for states in (["RUNNING", "FAILED"], ["RUNNING", None]):
        slurm = ScriptedSlurm(states)
        assert not requeue.lift_hold(slurm, "41", after=2, starter_alive=lambda: False)
        assert slurm.started_after == []


def test_the_begin_time_is_kept_ahead_until_the_helper_may_leave(monkeypatch):
    """Its starter gone, the job still completing (ranks, a template still ending): the job's begin
    time must still be ahead when it completes."""
    monkeypatch.setattr(requeue, "POLL_S", 0.01)
    slurm = ScriptedSlurm(["COMPLETING 1", "COMPLETING 1", "COMPLETING 1", "PENDING 1"])
    asked = []
    assert requeue.lift_hold(slurm, "41", after=1, starter_alive=lambda: False,
                             may_leave=lambda state: asked.append(state) or state == "PENDING")
    assert asked == ["COMPLETING", "COMPLETING", "COMPLETING", "PENDING"]
    assert len(slurm.started_after) == 4  # once more after each look that found the job completing


def test_the_helper_leaves_as_the_jobs_last_process_where_slurm_tracks_it(tmp_path, monkeypatch):
    """proctrack/cgroup: the helper is one of the job's processes, and the job completes only once
    it ends: it leaves when `scontrol listpids` shows nothing of the job here but itself. Where it
    is not listed (proctrack/linuxproc), it stays until the job has completed."""
    calls = fake_slurm_tools(tmp_path, monkeypatch, "COMPLETING 1")
    others = tmp_path / "others"
    others.write_text("4242\n")  # another process of the job, still ending
    (tmp_path / "bin" / "scontrol").write_text(
        '#!/bin/sh\nif [ "$1" = listpids ]; then echo "PID JOBID STEPID LOCALID GLOBALID"; '
        'for pid in $(cat "$OTHERS") $LISTED; do echo "$pid 41 0 0 0"; done; exit 0; fi\n'
        f'{FAKE_TOOLS["scontrol"]}\n')
    monkeypatch.setenv("OTHERS", str(others))
    helper = subprocess.Popen([sys.executable, "-c", "import os, subprocess, sys\n"
                               "os.environ['LISTED'] = str(os.getpid())\n"  # listed: tracked, as under cgroup
                               "from toolkit.watch import requeue\n"
                               "sys.exit(requeue.main(['41', '--starter', '1']))"],
                              stderr=subprocess.PIPE, text=True)
    wait_for_line(calls, "update JobId=41 StartTime=now+1")
    time.sleep(1)
    assert helper.poll() is None  # another process of the job is still here: the begin time kept ahead
    others.write_text("")
    assert helper.wait(timeout=20) == 0  # the last one here: it leaves, the job still completing


def test_a_refused_update_is_tried_again_until_the_wait_ends(monkeypatch):
    monkeypatch.setattr(requeue, "POLL_S", 0.01)
    slurm = ScriptedSlurm(["PENDING"], accept=False)
    assert not requeue.lift_hold(slurm, "41", after=2, starter_alive=lambda: False, wait_s=0.2)
    assert len(slurm.started_after) > 1


def test_the_helper_outlives_the_jobs_terminate_signal_and_lifts_the_hold(tmp_path, monkeypatch):
    """What Slurm does to a job it requeues (TERM to every process of it), done to the helper
    before the job is pending again: it must still be there to lift the hold."""
    calls = fake_slurm_tools(tmp_path, monkeypatch, "RUNNING 0")
    helper = requeue.lift_hold_soon("41", after=3, requeue=True, down=("n1", "ft: batch host lost"))
    assert helper is not None
    time.sleep(0.3)
    assert os.getpgid(helper.pid) == helper.pid  # its own session: srun's interrupts do not reach it
    os.kill(helper.pid, signal.SIGTERM)
    time.sleep(1.5)  # long enough for Python to start and poll: the TERM, ignored, is behind it
    assert helper.poll() is None
    (tmp_path / "state").write_text("PENDING 1")
    wait_for_line(calls, "update JobId=41 StartTime=now+3")
    assert helper.poll() is None  # its starter (this test) is alive: the begin time is kept ahead
    (tmp_path / "state").write_text("RUNNING 1")  # the new start
    assert helper.wait(timeout=20) == 0
    # The requeue before the mark: marking the node DOWN first ends the step the helper came from.
    assert calls.read_text().splitlines()[:3] == [
        "requeue 41", "update NodeName=n1 State=DOWN Reason=ft: batch host lost", "update JobId=41 StartTime=now+3"]


def test_the_helper_ends_with_its_starter(tmp_path, monkeypatch):
    calls = fake_slurm_tools(tmp_path, monkeypatch, "PENDING 1")
    starter = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                                "from toolkit.watch.requeue import lift_hold_soon\n"
                                "lift_hold_soon('41', after=-5)\n"
                                "time.sleep(float(sys.argv[1]))", "1.5"], stderr=subprocess.PIPE, text=True)
    assert starter.wait(timeout=30) == 0
    wait_for_line(calls, "update JobId=41 StartTime=now+1")  # never less than the margin
    lines = len(calls.read_text().splitlines())
    time.sleep(2)  # gone with its starter: no more updates
    assert len(calls.read_text().splitlines()) in (lines, lines + 1)
    assert "may start again 1 s after" in starter.stderr.read()


def wait_for_line(path: Path, line: str) -> None:
    for _ in range(200):
        if path.exists() and line in path.read_text().splitlines():
            return
        time.sleep(0.1)
    raise AssertionError(f"{line!r} never came: {path.read_text() if path.exists() else 'no calls'}")


def test_one_surviving_node_reports_a_lost_batch_host(tmp_path, monkeypatch):
    """Every survivor hears the batch host go quiet; the first to leave its mark requeues the job and
    marks the host DOWN (through the helper), the others leave it to that one. The loss goes into
    the run's events, where the goodput's accounts find it."""
    from toolkit.launch import node

    helpers = []
    monkeypatch.setattr(requeue, "lift_hold_soon", lambda job, **options: helpers.append((job, options)) or object())
    monkeypatch.setattr(node, "slurmd_answers", lambda address: False)
    (tmp_path / "marks").mkdir()
    for name, value in {"FT_WATCH_NODE": "n1", "SLURM_JOB_ID": "41", "FT_RUN_ID": "run-1",
                        "FT_RUN_DIR": str(tmp_path), "FT_LAUNCH_MARKS": str(tmp_path / "marks")}.items():
        monkeypatch.setenv(name, value)

    node.batch_host_lost("n1", 5.0)  # the batch host itself: its supervisor is its own business
    assert helpers == []
    node.batch_host_lost("n2", 5.0)
    node.batch_host_lost("n3", 5.0)

    ((job, options),) = helpers
    assert job == "41" and options["requeue"] and options["down"][0] == "n1"
    assert "run run-1" in options["down"][1]
    (event,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert event["event"] == "node_lost" and event["node"] == "n1" and event["reported_by"] == "n2"


def test_a_batch_host_whose_slurmd_answers_is_left_to_slurm_but_its_requeue_not_held(tmp_path, monkeypatch):
    """A supervisor quiet on a live node (a node that rebooted under the job, its slurmd back; a
    launcher of an earlier start it no longer answers): ft neither requeues nor marks anything, nor
    counts a fault, but lifts the hold on a requeue Slurm may make, once for all survivors. That
    does not use up the report of a real loss later in the same start."""
    from toolkit.launch import node

    helpers, answers = [], iter([True, True, False])
    monkeypatch.setattr(requeue, "lift_hold_soon", lambda job, **options: helpers.append((job, options)) or object())
    monkeypatch.setattr(node, "slurmd_answers", lambda address: next(answers))
    (tmp_path / "marks").mkdir()
    for name, value in {"FT_WATCH_NODE": "n1", "SLURM_JOB_ID": "41", "FT_RUN_DIR": str(tmp_path),
                        "FT_LAUNCH_MARKS": str(tmp_path / "marks")}.items():
        monkeypatch.setenv(name, value)

    node.batch_host_lost("n2", 5.0)
    node.batch_host_lost("n3", 5.0)
    assert helpers == [("41", {})] and not (tmp_path / "events.jsonl").exists()

    node.batch_host_lost("n3", 5.0)  # now really lost
    assert helpers[1][1]["requeue"] and helpers[1][1]["down"][0] == "n1"
    (event,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert event["event"] == "node_lost" and event["reported_by"] == "n3"
