"""Slurm's requeue hold, lifted from inside the job (toolkit/watch/requeue.py): the process that
stays, what it ends, and when it leaves. Slurm is a scripted stand-in here (the unit tests must not
touch the lab's jobs); the lab's recovery tests run the real thing (requeue_hold_lifted)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from toolkit.slurm.client import JobInfo
from toolkit.watch import requeue


class ScriptedSlurm:
    def __init__(self, states: list[str | None], accept: bool = True, pids: list[list[int]] | None = None):
        self.states, self.accept, self.started_after = states, accept, []
        self.pids = pids  # what `scontrol listpids` says at each look (None: it cannot tell)
        self.kill_wait = 30
        self.message_timeout: int | None = 10

    def job_brief(self, job_id: str) -> JobInfo | None:
        state = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        if state is None:
            return None
        name, restarts, nodes = (state.split(" ") + ["", ""])[:3]  # "STATE RESTARTS NODES-STILL-COMPLETING"
        return JobInfo(job_id, name, "scontrol", nodes=nodes, restarts=int(restarts or 0))

    def start_after(self, job_id: str, seconds: int) -> bool:
        self.started_after.append((job_id, seconds))
        return self.accept

    def config_seconds(self, name: str) -> int | None:
        return {"KillWait": self.kill_wait, "MessageTimeout": self.message_timeout}[name]

    def job_pids_here(self, job_id: str) -> list[int] | None:
        if self.pids is None:
            return None
        return self.pids.pop(0) if len(self.pids) > 1 else self.pids[0]


def test_a_requeued_job_still_completing_counts_as_requeued_once_its_restarts_went_up(monkeypatch):
    """The process that stays is one of the job's, so the job stays COMPLETING (pending underneath)
    until it leaves: it must act then, but not on a job that is only ending."""
    monkeypatch.setattr(requeue, "POLL_S", 0.01)
    slurm = ScriptedSlurm(["RUNNING 0", "COMPLETING 1"])
    assert requeue.lift_hold(slurm, "41", after=1, may_leave=lambda info: True, restarts=0)
    assert slurm.started_after == [("41", 1)]
    ending = ScriptedSlurm(["COMPLETING 0", "COMPLETED 0"])
    assert not requeue.lift_hold(ending, "41", after=1, may_leave=lambda info: True, restarts=0)
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
    assert requeue.lift_hold(slurm, "41", after=1, may_leave=lambda info: True)
    assert requeue.retried(lambda: (_ for _ in ()).throw(SlurmUnavailable("slow")), "requeueing", tries=2) is False


def test_a_job_started_again_ends_the_wait(monkeypatch):
    monkeypatch.setattr(requeue, "POLL_S", 0.01)
    slurm = ScriptedSlurm(["PENDING", "PENDING", "RUNNING"])
    assert requeue.lift_hold(slurm, "41", after=2, may_leave=lambda info: False)
    assert len(slurm.started_after) == 2


def test_a_job_that_ends_instead_is_left_alone(monkeypatch):
    monkeypatch.setattr(requeue, "POLL_S", 0.01)
    for states in (["RUNNING", "FAILED"], ["RUNNING", None]):
        slurm = ScriptedSlurm(states)
        assert not requeue.lift_hold(slurm, "41", after=2, may_leave=lambda info: True)
        assert slurm.started_after == []


def test_the_begin_time_is_kept_ahead_until_nothing_else_of_the_job_runs_here(monkeypatch):
    """Ranks, a template, srun's clients still ending: the job's begin time must still be ahead when
    it completes; the process that stays leaves as the job's last one on its node. Each look sets it a
    margin more than the second asked for: Slurm's KILL may end this process between two looks."""
    monkeypatch.setattr(requeue, "POLL_S", 0.01)
    me = os.getpid()
    # pid 1: a process still running; 999999999: the scontrol that listed it, gone since
    slurm = ScriptedSlurm(["COMPLETING 1"], pids=[[me, 1], [me, 1], [me, 999999999]])
    assert requeue.stay_as_last(slurm, "41", after=1, restarts=0)
    assert slurm.started_after == [("41", 4)] * 4  # at each look, and once more as it leaves


def test_as_slurms_kill_nears_the_begin_time_is_kept_further_ahead(monkeypatch):
    """Ranks hung on a lost peer's collective outlive the TERM: Slurm's KILL (KillWait later) ends
    them and the process that stays at once, and a step on another node may end seconds after."""
    monkeypatch.setattr(requeue, "POLL_S", 0.01)
    slurm = ScriptedSlurm(["COMPLETING 1"], pids=[[os.getpid(), 1]] * 3 + [[os.getpid()]])
    slurm.kill_wait = 0  # the KILL is due now
    assert requeue.stay_as_last(slurm, "41", after=1, restarts=0)
    assert set(slurm.started_after) == {("41", 1 + requeue.KILL_MARGIN_S)}


def test_where_the_steps_clients_died_with_their_node_the_begin_time_covers_slurms_tries_to_tell_them(
        monkeypatch):
    """The batch host lost without power: its srun clients of the job's steps closed nothing, and each
    step here completes only once its slurmstepd gave up telling its client that the tasks ended
    (twice MessageTimeout, measured on the lab), after this process left. A begin time of a few
    seconds would have passed by then, and Slurm's hold would be set after all."""
    monkeypatch.setattr(requeue, "POLL_S", 0.01)
    slurm = ScriptedSlurm(["COMPLETING 1"], pids=[[os.getpid()]])
    slurm.message_timeout = 7
    assert requeue.stay_as_last(slurm, "41", after=1, restarts=0, clients_lost=True)
    assert set(slurm.started_after) == {("41", 1 + requeue.LEAVING_MARGIN_S + 2 * 7)}
    unsaid = ScriptedSlurm(["COMPLETING 1"], pids=[[os.getpid()]])
    unsaid.message_timeout = None  # Slurm's default, where its configuration does not say
    assert requeue.stay_as_last(unsaid, "41", after=1, restarts=0, clients_lost=True)
    assert set(unsaid.started_after) == {("41", 1 + requeue.LEAVING_MARGIN_S + 2 * 10)}
    alive = ScriptedSlurm(["COMPLETING 1"], pids=[[os.getpid()]])  # clients alive: no wait for them
    assert requeue.stay_as_last(alive, "41", after=1, restarts=0)
    assert set(alive.started_after) == {("41", 1 + requeue.LEAVING_MARGIN_S)}


def test_it_stays_while_another_node_still_completes_the_job(monkeypatch):
    """Alone on its node, but a step on another node still ending (its slurmstepd retrying a dead
    srun, say): the job completes only after that one, so the begin time is kept ahead until then."""
    monkeypatch.setattr(requeue, "POLL_S", 0.01)
    monkeypatch.setenv("SLURMD_NODENAME", "n2")
    slurm = ScriptedSlurm(["COMPLETING 1 n[2-3]", "COMPLETING 1 n[2-3]", "COMPLETING 1 n2"], pids=[[os.getpid()]])
    assert requeue.stay_as_last(slurm, "41", restarts=0)
    assert len(slurm.started_after) == 4  # three looks, then as it leaves


def test_where_slurm_cannot_list_the_jobs_processes_it_leaves_at_once(monkeypatch):
    monkeypatch.setattr(requeue, "POLL_S", 0.01)
    slurm = ScriptedSlurm(["PENDING 1"], pids=None)
    assert requeue.stay_as_last(slurm, "41", restarts=0)
    assert slurm.started_after == [("41", 4), ("41", 4)]


def test_a_refused_update_is_tried_again_until_the_wait_ends(monkeypatch):
    monkeypatch.setattr(requeue, "POLL_S", 0.01)
    slurm = ScriptedSlurm(["PENDING"], accept=False)
    assert not requeue.lift_hold(slurm, "41", after=2, may_leave=lambda info: True, wait_s=0.2)
    assert len(slurm.started_after) > 1


def test_every_process_it_started_ends_before_it_stays(monkeypatch):
    """srun's clients (one of a step that spanned a lost node never ends by itself) and what they
    started: a requeued job completes only once they are all gone."""
    client = subprocess.Popen(["/bin/sh", "-c", "sleep 60 & sleep 60; wait"])
    for _ in range(100):  # the grandchildren started
        if len(requeue.descendants(client.pid)) == 2:
            break
        time.sleep(0.02)
    tree = [client.pid, *requeue.descendants(client.pid)]
    assert len(tree) == 3
    requeue.end_descendants()
    assert client.poll() is not None  # reaped

    def alive(pid: int) -> bool:  # a KILL lands within moments; a zombie is init's to reap
        try:
            return ") Z " not in Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False

    for _ in range(100):
        if not any(alive(pid) for pid in tree):
            break
        time.sleep(0.02)
    assert not any(alive(pid) for pid in tree)


def test_one_surviving_node_reports_a_lost_batch_host(tmp_path, monkeypatch):
    """Every survivor hears the batch host go quiet; the first to leave its mark requeues the job and
    marks the host DOWN, in that order, and lifts the hold as it ends; the others leave it to that
    one. The loss goes into the run's events, where the goodput's accounts find it."""
    from toolkit.launch import node

    calls = []

    class Slurm:
        def requeue(self, job):
            calls.append(("requeue", job))
            return True

        def mark_node_down(self, node_name, reason):
            calls.append(("down", node_name, reason))
            return True

    monkeypatch.setattr("toolkit.slurm.client.CliSlurmClient", Slurm)
    monkeypatch.setattr(node, "REQUEUED_AT", [])
    monkeypatch.setattr(node, "SILENT_AFTER", [])
    monkeypatch.setattr(node, "slurmd_answers", lambda address: False)
    (tmp_path / "marks").mkdir()
    for name, value in {"FT_WATCH_NODE": "n1", "SLURM_JOB_ID": "41", "FT_RUN_ID": "run-1",
                        "FT_RUN_DIR": str(tmp_path), "FT_LAUNCH_MARKS": str(tmp_path / "marks")}.items():
        monkeypatch.setenv(name, value)

    node.batch_host_lost("n1", 5.0)  # the batch host itself: its supervisor is its own business
    assert calls == [] and not node.REQUEUED_AT
    node.batch_host_lost("n2", 5.0)
    node.batch_host_lost("n3", 5.0)

    assert [call[:2] for call in calls] == [("requeue", "41"), ("down", "n1")]  # the requeue first
    assert "run run-1" in calls[1][2] and bool(node.REQUEUED_AT)
    (event,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert event["event"] == "node_lost" and event["node"] == "n1" and event["reported_by"] == "n2"


class Survivors:
    """Slurm and the survivors' heartbeat senders as a lost batch host's survivors see them: every
    call, in order. The batch host n1 trained; n2 and n3 survive it."""

    def __init__(self, refuses_requeue: bool = False):
        self.calls: list = []
        self.refuses_requeue = refuses_requeue
        survivors = self

        class Slurm:
            def requeue(self, job):
                return survivors.calls.append("requeue") or not survivors.refuses_requeue

            def mark_node_down(self, node_name, reason):
                return survivors.calls.append("down") or True

        self.slurm = Slurm

    def sender(self, name: str):
        calls = self.calls

        class Sender:
            def peers_gone(self, nodes):
                calls.append((f"{name} stops its ranks", nodes))

        return Sender()


@pytest.fixture
def survivors(tmp_path, monkeypatch):
    from toolkit.launch import node

    found = Survivors()
    monkeypatch.setattr("toolkit.slurm.client.CliSlurmClient", found.slurm)
    monkeypatch.setattr(node, "REQUEUED_AT", [])
    monkeypatch.setattr(node, "SILENT_AFTER", [])
    monkeypatch.setattr(node, "REQUEUE_MARK_WAIT_S", 0.3)
    monkeypatch.setattr(node, "KEEPING_DOWN", [])
    monkeypatch.setattr("toolkit.watch.silence.keep_down", lambda slurm, host, *rest: f"keeping {host} down")
    monkeypatch.setattr(node, "slurmd_answers", lambda address: False)
    (tmp_path / "marks").mkdir()
    for name, value in {"FT_WATCH_NODE": "n1", "FT_WATCH_NODES": "n1,n2,n3", "SLURM_JOB_ID": "41",
                        "FT_RUN_DIR": str(tmp_path), "FT_LAUNCH_MARKS": str(tmp_path / "marks")}.items():
        monkeypatch.setenv(name, value)
    return found


def test_survivors_stop_their_ranks_at_once_when_the_lost_batch_host_trained(survivors):
    """The batch host trained ranks of this start: no checkpoint can be taken without them, and a host
    without power closes none of their connections, so the survivors' ranks would wait in their
    collectives (the requeue's TERM, a checkpoint, included) until Slurm's KILL. The reporter stops
    its ranks once the requeue is taken; the others on its word (a mark)."""
    from toolkit.launch import node

    assert node.batch_host_lost("n2", 1.2, sender=survivors.sender("n2")) is True
    assert node.batch_host_lost("n3", 1.3, sender=survivors.sender("n3")) is True
    assert survivors.calls == ["requeue", ("n2 stops its ranks", ["n1"]), "down", ("n3 stops its ranks", ["n1"])]
    assert node.SILENT_AFTER == ["n1"]  # its srun clients lost with it: the hold's lift waits for their steps
    # Slurm may take n1 back on a stale word: the reporter's looks at it, which it waits for before it
    # ends (its ranks stopped, it would otherwise end before the last look, and Slurm's own
    # "Not responding" replace ft's reason: seen on the lab).
    assert node.KEEPING_DOWN == ["keeping n1 down"]


@pytest.mark.parametrize("refused, flapped", [(True, False), (False, True)])
def test_no_ranks_are_stopped_where_slurm_refused_the_requeue_or_the_host_answers_again(
        survivors, refused, flapped):
    """A requeue refused (no rights, requeue off): nothing would end this start, so its ranks go on.
    A host that answers again right after the requeue (a flap): the requeue stands, and its TERM's
    checkpoint may still be taken with every rank. Neither survivor stops its ranks."""
    from toolkit.launch import node

    survivors.refuses_requeue = refused
    answers = iter([True, not flapped])  # still quiet: before the report, and after the requeue
    node.batch_host_lost("n2", 1.2, still_quiet=lambda: next(answers), sender=survivors.sender("n2"))
    node.batch_host_lost("n3", 1.3, sender=survivors.sender("n3"))
    assert survivors.calls == ["requeue"] + (["down"] if not flapped else [])
    # The host answered again: its srun clients too, so the hold's lift waits for no orphaned step.
    assert node.SILENT_AFTER == []


def test_a_batch_host_whose_slurmd_answers_is_left_to_slurm(tmp_path, monkeypatch):
    """A supervisor quiet on a live node (a node that rebooted under the job, its slurmd back; a
    launcher of an earlier start it no longer answers): ft neither requeues nor marks anything, nor
    counts a fault (Slurm's own requeue, if it makes one, waits out its hold). That
    does not use up the report of a real loss later in the same start."""
    from toolkit.launch import node

    calls, answers = [], iter([True, True, False, False])

    class Slurm:
        def requeue(self, job):
            return calls.append(("requeue", job)) or True

        def mark_node_down(self, node_name, reason):
            return calls.append(("down", node_name)) or True

    monkeypatch.setattr("toolkit.slurm.client.CliSlurmClient", Slurm)
    monkeypatch.setattr(node, "REQUEUED_AT", [])
    monkeypatch.setattr(node, "SILENT_AFTER", [])
    monkeypatch.setattr(node, "slurmd_answers", lambda address: next(answers))
    (tmp_path / "marks").mkdir()
    for name, value in {"FT_WATCH_NODE": "n1", "SLURM_JOB_ID": "41", "FT_RUN_DIR": str(tmp_path),
                        "FT_LAUNCH_MARKS": str(tmp_path / "marks")}.items():
        monkeypatch.setenv(name, value)

    assert node.batch_host_lost("n2", 1.0, timeout=10) is False  # asked again while the silence lasts
    assert node.batch_host_lost("n3", 10.0, timeout=10) is True  # the timeout reached: Slurm's to judge
    # Nothing to lift either: a launcher that stayed for a requeue that may never come would hold
    # every later end of its step (a restart inside the job, a cancel) for the wait.
    assert calls == [] and not node.REQUEUED_AT and not (tmp_path / "events.jsonl").exists()

    # Its own link back after a flap: an answer came while the probe failed: nothing reported.
    assert node.batch_host_lost("n3", 1.0, timeout=10, still_quiet=lambda: False) is False
    assert calls == [] and not node.REQUEUED_AT
    assert node.batch_host_lost("n3", 1.0, timeout=10) is True  # now really lost
    assert calls == [("requeue", "41"), ("down", "n1")]
    (event,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert event["event"] == "node_lost" and event["reported_by"] == "n3"


def test_the_lift_is_recorded_as_it_happens(monkeypatch):
    """Slurm's KILL may end the process that stays before it leaves: the record comes first."""
    monkeypatch.setattr(requeue, "POLL_S", 0.01)
    seen: list[str] = []
    slurm = ScriptedSlurm(["COMPLETING 1"], pids=[[os.getpid(), 1]] * 3 + [[os.getpid()]])
    assert requeue.stay_as_last(slurm, "41", on_lifted=lambda: seen.append(f"lifted after {len(slurm.started_after)}"))
    assert seen == ["lifted after 1"]


def test_the_launchers_probe_uses_the_supervisors_slurmd_port_and_none_known_is_no_sign_of_loss(monkeypatch):
    """No Slurm command on the node (a container): the port comes from the supervisor. A refused
    connection is an answer that no slurmd listens; a listening one answers."""
    import socket

    from toolkit.launch import node

    monkeypatch.delenv("FT_WATCH_SLURMD_PORT", raising=False)
    assert node.slurmd_answers("127.0.0.1") is True  # nothing known, nothing asked
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        monkeypatch.setenv("FT_WATCH_SLURMD_PORT", str(listening.getsockname()[1]))
        assert node.slurmd_answers("127.0.0.1") is True
    assert node.slurmd_answers("127.0.0.1") is False  # the port closed: refused
