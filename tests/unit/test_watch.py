"""ft's watchdog, piece by piece, with real processes, pipes, signals and UDP on loopback: the
heartbeat refuses what the job did not send, the hang rule, a hung worker's stacks dumped with
py-spy before it is stopped, and the supervisor's decisions. Slurm itself is not here: a fake
`srun` plays the step's launchers (sending real heartbeats) and a fake client records what would
be marked DOWN; the lab tests (tests/lab/test_recovery.py) run the real thing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.support.run_specs import run_spec, write_run_spec
from toolkit.job.supervise import FLOOD_DATAGRAMS
from toolkit.recipe.schema import WatchdogSpec
from toolkit.runs.layout import RunLayout
from toolkit.watch.heartbeat import Receiver, Sender, seal
from toolkit.watch.progress import HangRule, NodeProgress, Reporter

SECRET = b"s" * 64


def test_heartbeats_reach_the_receiver_and_forged_replayed_or_stale_ones_do_not():
    receiver = Receiver(SECRET, host="127.0.0.1")
    start = receiver.next_start()
    sender = Sender("127.0.0.1", receiver.port, SECRET, "node1", start, state=lambda: {"ranks": {"0": ["step", 3]}})
    sender.send()
    receiver.poll(time.monotonic() + 0.5)
    assert receiver.nodes["node1"].message["ranks"] == {"0": ["step", 3]}
    heard = receiver.nodes["node1"].last

    attacker = Sender("127.0.0.1", receiver.port, b"x" * 64, "node2", start, state=dict)
    attacker.send()  # wrong secret
    replay = seal(SECRET, {"node": "node1", "start": start, "seq": 1})  # a sequence number already seen
    stale = seal(SECRET, {"node": "node3", "start": start - 1, "seq": 9})  # a launcher of an earlier start
    for datagram in (replay, stale, b"junk", b"x" * 5000):
        sender.socket.sendto(datagram, ("127.0.0.1", receiver.port))
    receiver.poll(time.monotonic() + 0.5)
    assert set(receiver.nodes) == {"node1"} and receiver.nodes["node1"].last == heard
    assert receiver.refused == 5


def test_a_datagram_that_breaks_the_reader_unforeseen_is_refused_and_the_reader_reads_on(monkeypatch):
    """heartbeat.py's blind except in the reader: a datagram whose handling raises what nobody foresaw
    is refused, and the reader thread goes on to hear the next heartbeat (a dead reader would make
    every node look lost; narrowed to OSError, this test fails: checked)."""
    import socket

    from toolkit.watch import heartbeat

    class Unforeseen(Exception):
        pass

    real_unseal = heartbeat.unseal

    def unseal(secret, datagram, tag=None):
        if b"poison" in datagram:
            raise Unforeseen("a datagram nobody foresaw")
        return real_unseal(secret, datagram, tag)

    monkeypatch.setattr(heartbeat, "unseal", unseal)
    failed = []
    monkeypatch.setattr(threading, "excepthook", failed.append)
    receiver = Receiver(SECRET, host="127.0.0.1").listen()
    start = receiver.next_start()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
        sender.sendto(seal(SECRET, {"node": "node9", "start": start, "seq": 1, "poison": 1}),
                      ("127.0.0.1", receiver.port))
        time.sleep(0.3)
        sender.sendto(seal(SECRET, {"node": "node1", "start": start, "seq": 1}), ("127.0.0.1", receiver.port))
        deadline = time.monotonic() + 5
        while "node1" not in receiver.seen() and time.monotonic() < deadline:
            time.sleep(0.05)
    receiver.close()
    assert set(receiver.seen()) == {"node1"} and receiver.refused == 1 and failed == []


def test_a_launcher_notices_once_when_the_supervisor_stops_answering():
    from toolkit.watch.silence import QUIET_S

    receiver = Receiver(SECRET, host="127.0.0.1")
    silences = []

    def report(quiet: float) -> bool:  # telling Slurm takes a while (scontrol, twice)
        time.sleep(1.0)
        silences.append(quiet)
        return True

    sender = Sender("127.0.0.1", receiver.port, SECRET, "node2", receiver.next_start(), state=dict, silence_s=10,
                    on_silence=report).start()
    receiver.poll(time.monotonic() + 2.5)  # answers each heartbeat
    assert sender.answered is not None and silences == []
    receiver.close()  # the batch host is gone; and the launcher fails (its collective broke)
    began = time.monotonic()
    sender.stop(1, linger=4)
    # Asked about after QUIET_S, not the 10 s timeout; reported once, and the report was through
    # before the launcher could end.
    assert len(silences) == 1 and QUIET_S <= silences[0] < QUIET_S + 1 and time.monotonic() - began < 4


def test_a_judged_silence_is_judged_afresh_once_answers_come_back_and_a_failing_judge_stops():
    receiver = Receiver(SECRET, host="127.0.0.1")
    asked = []
    sender = Sender("127.0.0.1", receiver.port, SECRET, "node2", receiver.next_start(), state=dict, silence_s=10,
                    on_silence=lambda quiet: asked.append(quiet) or True).start()
    receiver.poll(time.monotonic() + 0.6)
    time.sleep(1.8)  # quiet: judged once
    receiver.poll(time.monotonic() + 0.6)  # answers again
    time.sleep(1.8)  # quiet again: judged again
    assert len(asked) == 2
    sender.on_silence = lambda quiet: asked.append(1 / 0)  # Slurm's commands missing, say: raises
    receiver.poll(time.monotonic() + 0.6)
    time.sleep(2.0)
    assert len(asked) == 2 and sender.judged  # tried once, then left (not a new thread every heartbeat)
    sender.stop(0)
    receiver.close()


def test_a_silence_not_yet_judged_is_asked_about_again_while_it_lasts():
    """The batch host's slurmd still answers (a supervisor starved of CPU, say): asked again while
    the silence lasts, until it is judged; a heartbeat answered again ends the asking."""
    receiver = Receiver(SECRET, host="127.0.0.1")
    asked = []
    sender = Sender("127.0.0.1", receiver.port, SECRET, "node2", receiver.next_start(), state=dict, silence_s=10,
                    on_silence=lambda quiet: asked.append(quiet) or len(asked) == 3).start()
    receiver.poll(time.monotonic() + 1.0)
    time.sleep(3)  # the supervisor quiet
    assert len(asked) == 3 and asked == sorted(asked)  # judged at the third: not asked after
    receiver.poll(time.monotonic() + 1.0)
    sender.stop(0)
    receiver.close()


def test_a_failing_launcher_lingers_only_until_the_supervisor_answers():
    receiver = Receiver(SECRET, host="127.0.0.1")
    sender = Sender("127.0.0.1", receiver.port, SECRET, "node2", receiver.next_start(), state=dict, silence_s=5,
                    on_silence=lambda quiet: None).start()
    answering = threading.Thread(target=receiver.poll, args=(time.monotonic() + 4,))
    answering.start()
    time.sleep(1.5)
    began = time.monotonic()
    sender.stop(1, linger=7)
    assert time.monotonic() - began < 2.5  # answered within a heartbeat or so
    answering.join()
    assert receiver.nodes["node2"].message["exit_code"] == 1


def test_a_rank_is_hung_when_late_by_k_median_steps_and_at_least_the_floor():
    progress = NodeProgress([0, 1], HangRule(hang_factor=10, hang_floor=5, startup_timeout=60))
    began = time.monotonic()
    for step in range(1, 11):  # 1 s a step on both ranks
        for rank in (0, 1):
            progress.feed(rank, f"step {step}\n".encode(), now=began + step)
    assert progress.hung(now=began + 10 + 9.5) == {}
    assert set(progress.hung(now=began + 10 + 10.5)) == {0, 1}  # 10 x the 1 s median
    # A fast rank still gets the floor; a save or the export gets the startup limit.
    fast = NodeProgress([0], HangRule(hang_factor=10, hang_floor=5, startup_timeout=60))
    for step in range(1, 11):
        fast.feed(0, f"step {step}\n".encode(), now=began + step * 0.01)
    assert fast.hung(now=began + 0.1 + 4) == {} and fast.hung(now=began + 0.1 + 6)
    fast.feed(0, b"save 10\n", now=began + 1)
    assert fast.hung(now=began + 50) == {} and "save 10" in fast.hung(now=began + 62)[0]
    # The save over, the worker says so: a rank stuck right after a checkpoint is hung after the
    # floor, not after the startup limit (a hang injected just after a save once went unseen).
    fast.feed(0, b"step 10\n", now=began + 2)
    assert fast.hung(now=began + 2 + 4) == {} and fast.hung(now=began + 2 + 6)
    assert len(fast.ranks[0].intervals) == 9  # the save's time is not a step's


def test_the_hang_bound_follows_the_runs_own_longest_steps():
    """Steps of 1 s with now and then one of 8 s (a logging step's sync, a background write): the
    bound is 3 x the longest (24 s), not 10 x the median (10 s), so the slow ones are not hangs."""
    progress = NodeProgress([0], HangRule(hang_factor=10, hang_floor=5, startup_timeout=60))
    now = 0.0
    for step in range(1, 21):
        now += 8.0 if step == 10 else 1.0
        progress.feed(0, f"step {step}\n".encode(), now=now)
    assert progress.ranks[0].limit(progress.rule) == 24.0
    assert progress.hung(now=now + 23) == {} and progress.hung(now=now + 25)
    # The recipe's defaults: a run of 0.3 s steps is hung after the 10 s floor, not two minutes.
    defaults = NodeProgress([0], HangRule.of(WatchdogSpec()))
    for step in range(1, 21):
        defaults.feed(0, f"step {step}\n".encode(), now=step * 0.3)
    assert defaults.ranks[0].limit(defaults.rule) == 10


def test_silence_is_a_loss_at_once_where_the_slurmd_does_not_answer_and_after_the_timeout_otherwise():
    from toolkit.watch.silence import PROBE_EVERY_S, QUIET_S, SilenceRule

    probed = []
    rule = SilenceRule(timeout=10, probe=lambda node: probed.append(node) or node != "crashed")
    assert rule.lost({"crashed": QUIET_S / 2, "busy": QUIET_S / 2}, 8) == {} and probed == []  # too soon to ask
    lost = rule.lost({"crashed": QUIET_S + 0.1, "busy": QUIET_S + 0.1}, 8)
    assert list(lost) == ["crashed"] and "slurmd does not answer" in lost["crashed"]
    assert sorted(probed) == ["busy", "crashed"]
    assert rule.lost({"busy": QUIET_S + 0.2}, 8) == {} and probed.count("busy") == 1  # not asked again so soon
    time.sleep(PROBE_EVERY_S)
    assert rule.lost({"busy": QUIET_S + 0.8}, 8) == {} and probed.count("busy") == 2
    assert rule.lost({"busy": 0.1}, 8) == {} and "busy" not in rule.asked  # heard again: asked afresh next time
    assert rule.lost({"busy": 10.0}, 8) == {"busy": "no heartbeat for 10 s"}  # alive or not: the timeout is the end

    slow = SilenceRule(timeout=10, probe=lambda node: time.sleep(0.4) or False)
    began = time.monotonic()
    assert len(slow.lost({f"n{i}": 2.0 for i in range(3)}, 8)) == 3
    assert time.monotonic() - began < 1.2  # three nodes asked at once, not one after the other


def test_a_node_slurm_takes_back_on_an_old_word_is_marked_down_again_while_it_stays_dead():
    """ReturnToService=2 on Slurm 24.11: a node marked DOWN a second after its crash was back in
    service 0.15 s later (on a response from before the crash), for the requeued job to land on."""
    from toolkit.watch.silence import keep_down

    class Slurm:
        def __init__(self, takes_back: int):
            self.takes_back, self.marks = takes_back, 0

        def unresponsive(self, nodes):
            return [] if self.takes_back > self.marks else nodes  # back in service until marked enough

        def mark_node_down(self, node, reason):
            self.marks += 1
            return True

    said = []
    back_once = Slurm(takes_back=1)
    keep_down(back_once, "n3", "ft: lost", lambda: True, said.append, looks=(0.05, 0.1)).join()
    assert back_once.marks == 1 and "marked DOWN again" in said[0]
    alive_again = Slurm(takes_back=5)  # taken back, and rightly: it answers (rebooted)
    keep_down(alive_again, "n3", "ft: lost", lambda: False, said.append, looks=(0.05, 0.1)).join()
    assert alive_again.marks == 0 and len(said) == 1

    class Broken(Slurm):  # Slurm's client failing in a way nobody foresaw: the watch ends, quietly
        def unresponsive(self, nodes):
            raise RuntimeError("sinfo printed something new")

    failed = []
    previous, threading.excepthook = threading.excepthook, failed.append
    try:
        broken = Broken(takes_back=1)
        watcher = keep_down(broken, "n3", "ft: lost", lambda: True, said.append, looks=(0.05, 0.1))
        watcher.join(5)
    finally:
        threading.excepthook = previous
    assert not watcher.is_alive() and broken.marks == 0 and failed == [] and len(said) == 1


def test_half_the_nodes_quiet_at_once_is_the_askers_own_network_and_waits_for_the_timeout():
    """A link flap on the batch host silences every node and fails every probe: no node is lost in
    a second for it (the supervisor asks Slurm at the timeout). One node of eight is asked at once."""
    from toolkit.watch.silence import QUIET_S, SilenceRule

    probed = []
    rule = SilenceRule(timeout=10, probe=lambda node: probed.append(node) or False)
    assert rule.lost({f"n{i}": QUIET_S + 0.5 for i in range(4)}, 8) == {} and probed == []
    assert rule.lost({f"n{i}": 10.0 for i in range(4)}, 8) == {f"n{i}": "no heartbeat for 10 s" for i in range(4)}
    assert list(rule.lost({"n0": QUIET_S + 0.5}, 8)) == ["n0"] and probed == ["n0"]


def test_progress_lines_split_across_reads_count_and_junk_does_not():
    progress = NodeProgress([0], HangRule.of(WatchdogSpec()))
    progress.feed(0, b"ste")
    progress.feed(0, b"p 7\nstep x\nwhatever 9\n" + b"z" * 10_000)
    assert progress.summary() == {"0": ["step", 7]}
    assert len(progress.partial[0]) <= 64  # a runaway line is cut, not kept


def test_a_worker_never_blocks_on_a_full_progress_pipe(monkeypatch):
    read_end, write_end = os.pipe()
    monkeypatch.setenv("FT_PROGRESS_FD", str(write_end))
    reporter = Reporter()
    began = time.monotonic()
    for step in range(200_000):  # far more than a pipe holds, never read
        reporter.report("step", step)
    assert time.monotonic() - began < 10
    os.close(read_end)
    reporter.report("step", 1)  # the launcher gone: silently stops reporting
    assert reporter.fd is None


HANGING_WORKER = textwrap.dedent("""
    import os, time
    fd = int(os.environ["FT_PROGRESS_FD"])
    for step in range(1, 30):
        os.write(fd, f"step {step}\\n".encode())
        time.sleep(0.05)
    def stuck_in_a_collective():
        time.sleep(120)
    stuck_in_a_collective()
""")


def test_a_launcher_hears_of_a_lost_peer_and_stops_its_ranks_at_once(tmp_path):
    """The supervisor found node3 lost: its answers say so, and node2's launcher kills its ranks
    within a heartbeat (they would wait on node3's collectives until Slurm's KILL). A new start
    begins with no node lost."""
    from toolkit.launch.workers import supervise

    receiver = Receiver(SECRET, host="127.0.0.1").listen()
    sender = Sender("127.0.0.1", receiver.port, SECRET, "node2", receiver.next_start(), state=dict).start()
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.6)
        assert not sender.peers_lost.is_set()
        receiver.tell_lost(["node3"])
        began = time.monotonic()
        progress = NodeProgress([0], HangRule(hang_factor=10, hang_floor=60, startup_timeout=60))
        code = supervise(RunLayout(tmp_path), "here", {0: worker}, progress, threading.Lock(), True,
                         sender.peers_lost, lambda: sender.lost)
        assert code == 1 and worker.poll() is not None and sender.lost == ["node3"]
        assert time.monotonic() - began < 1.5
        receiver.next_start()
        assert receiver.lost == []
    finally:
        worker.kill()
        sender.stop(0)
        receiver.close()


def test_a_hung_worker_has_its_stacks_dumped_then_is_stopped(tmp_path):
    from toolkit.launch.workers import read_progress, supervise
    from toolkit.runs import exits

    (tmp_path / "logs").mkdir()
    read_end, write_end = os.pipe()
    worker = subprocess.Popen([sys.executable, "-c", HANGING_WORKER], pass_fds=(write_end,),
                              env=dict(os.environ, FT_PROGRESS_FD=str(write_end)))
    os.close(write_end)
    progress, lock = NodeProgress([0], HangRule(hang_factor=5, hang_floor=1, startup_timeout=30)), threading.Lock()
    threading.Thread(target=read_progress, args=({0: read_end}, progress, lock), daemon=True).start()
    began = time.monotonic()

    code = supervise(RunLayout(tmp_path), "here", {0: worker}, progress, lock, watching=True)

    assert code == exits.HUNG and worker.poll() is not None
    assert RunLayout(tmp_path).read_exit_status() == exits.HUNG  # srun would report 15 for the ranks it stopped
    assert 2 < time.monotonic() - began < 20
    (dump,) = (tmp_path / "logs" / "stacks").glob("rank-0.*.txt")
    assert "stuck_in_a_collective" in dump.read_text()


FAKE_SRUN = textwrap.dedent("""
    # A fake srun: one thread per node of --nodelist sends the launcher's heartbeats. What each
    # start does comes from the script named by FAKE_PLAN: {start: {"lose": node, "exit": code}}.
    import json, os, signal, sys, threading, time
    from toolkit.watch.heartbeat import Sender
    nodes = next(a for a in sys.argv if a.startswith("--nodelist=")).split("=", 1)[1].split(",")
    plans = json.loads(open(os.environ["FAKE_PLAN"]).read())
    if sys.argv[-1] == "toolkit.launch.warm":  # a node's template step: runs until stopped, or fails at once
        with open(os.path.join(os.path.dirname(os.environ["FAKE_LOG"]), "warm.log"), "a") as log:
            log.write(json.dumps({"nodes": nodes, "time": time.time()}) + "\\n")
        if nodes[0] in plans.get("warm_fails", []):
            sys.exit(1)
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        time.sleep(600)
    start = int(os.environ["FT_WATCH_START"])
    plan = plans.get(str(start), {})
    with open(os.environ["FAKE_LOG"], "a") as log:
        log.write(json.dumps({"start": start, "nodes": nodes, "argv": sys.argv[1:], "warm": os.environ["FT_WARM"],
                              "time": time.time()}) + "\\n")
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))
    for node in nodes:  # each launcher's mark as it starts (toolkit/launch/node.py)
        if node != plan.get("unstarted"):
            open(os.path.join(os.environ["FT_LAUNCH_MARKS"], node), "w").close()
    nodes = [n for n in nodes if n != plan.get("unstarted")]
    if plan.get("launch_fails"):  # srun's words (the job script sends its stderr there), then its wait
        with open(os.path.join(os.environ["FT_LAUNCH_MARKS"], "srun.err"), "a") as errors:
            errors.write(f"srun: error: Task launch for StepId=77.2 failed on node {plan['unstarted']}: "
                         "Communication connection failure\\nsrun: error: Application launch failed: "
                         "Communication connection failure\\n")
        time.sleep(plan["launch_fails"])
    trains = (lambda: {"ranks": {"0": ["train", 3]}}) if plan.get("trains") else dict  # a rank's step reported
    senders = {n: Sender(os.environ["FT_WATCH_ADDR"], int(os.environ["FT_WATCH_PORT"]),
                         os.environ["FT_JOB_SECRET"].encode(), n, start, trains) for n in nodes}
    for node, sender in senders.items():
        sender.send()
    deadline = time.monotonic() + plan.get("seconds", 2)
    while time.monotonic() < deadline:
        time.sleep(0.3)
        for node, sender in senders.items():
            muted = plan.get("mute") == node and 0 < time.monotonic() - deadline + plan.get("seconds", 2) \
                - plan.get("mute_after", 0) < plan.get("mute_for", 0)  # its beats lost on the way
            if node != plan.get("lose") and not muted:
                sender.send()
    if plan.get("exit") == 6:  # a hang: each launcher's rank_hung, the blame on plan["hung_on"] (if any)
        from pathlib import Path
        from toolkit.runs.timeline import record
        for node in nodes:
            blamed = "stopped (SIGSTOP, or a debugger)" if node in plan.get("hung_on", []) else None
            record(Path(os.environ["FAKE_PLAN"]).parent, "rank_hung", node=node, rank=nodes.index(node), start=start,
                   why="no progress for 10 s", blamed=blamed)
    if plan.get("lose"):
        time.sleep(plan.get("linger", 60))  # srun waits for a lost node, as the real one does until it is DOWN
    for node, sender in senders.items():
        if node != plan.get("lose"):  # a crashed node says no goodbye
            sender.exit_code = plan.get("exit", 0)
            sender.send()
    sys.exit(plan.get("exit", 0))
""")


class FakeSlurm:
    """Stands in for Slurm in a unit test (the lab tests use the real one)."""

    def __init__(self, nodes: list[str], drains: dict | None = None):
        self.nodes, self.downed, self.drains, self.lifted = nodes, [], drains or {}, []
        self.began = time.monotonic()
        self.not_answering: set[str] = set()  # nodes whose slurmd Slurm says does not answer
        self.crashed: set[str] = set()  # nodes whose slurmd takes no connection (the plan's lost ones)
        self.drains_made: list[tuple[str, str]] = []  # by ft: drain_node

    def hostnames(self, nodelist: str) -> list[str]:
        return self.nodes

    def mark_node_down(self, node: str, reason: str) -> bool:
        self.downed.append((node, reason))
        return True

    def drain_node(self, node: str, reason: str) -> bool:
        self.drains_made.append((node, reason))
        return True

    def lift_hold(self, job_id: str) -> None:
        """The job's expect_requeue's stand-in (toolkit/job/controller.py, tested in test_job_controller.py)."""
        self.lifted.append(job_id)

    def node_addresses(self, nodes: list[str]) -> dict[str, str]:
        return {node: f"addr-{node}" for node in nodes if node != "unlisted"}  # the test's nodes do not resolve

    def slurmd_answers(self, address: str, port: int) -> bool:
        return address.removeprefix("addr-") not in self.crashed

    def config_number(self, name: str) -> int:
        return {"SlurmdPort": 6818}[name]

    def unresponsive(self, nodes: list[str]) -> list[str]:
        """Not answering Slurm, or marked DOWN (as sinfo says either)."""
        downed = {node for node, _ in self.downed}
        return [node for node in nodes if node in self.not_answering or node in downed]

    def drained(self, nodes: list[str]) -> dict[str, str]:
        """drains: {node: seconds after the start when a health check drains it}."""
        return {node: "ft-healthcheck: 20-gpu: XID 79" for node, after in self.drains.items()
                if node in nodes and time.monotonic() - self.began > after}


def supervised(tmp_path, monkeypatch, allocation: list[str], nodes: int, plan: dict, srun_options=(), drains=None,
               during=None, batch_host="localhost", **watchdog):
    from toolkit.job.supervise import Supervisor

    write_run_spec(tmp_path, run_spec(nodes, {"heartbeat_timeout": 2, "startup_timeout": 30, "max_restarts": 3,
                                              **watchdog}))
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    srun = tmp_path / "srun"
    srun.write_text(f"#!{sys.executable}\n{FAKE_SRUN}")
    srun.chmod(0o755)
    (tmp_path / "marks").mkdir(exist_ok=True)
    for name, value in {"FT_JOB_SECRET": SECRET.decode(), "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "x",
                        "SLURMD_NODENAME": batch_host, "FT_RUN_ID": "run-1", "FAKE_PLAN": str(tmp_path / "plan.json"),
                        "FAKE_LOG": str(tmp_path / "srun.log"), "FT_LAUNCH_MARKS": str(tmp_path / "marks"),
                        "PYTHONPATH": str(Path(__file__).resolve().parents[2])}.items():
        monkeypatch.setenv(name, value)
    slurm = FakeSlurm(allocation, drains)
    slurm.crashed = {start["lose"] for start in plan.values() if isinstance(start, dict) and "lose" in start}
    supervisor = Supervisor([str(srun), *srun_options, "python", "-m", "toolkit.launch"], tmp_path, slurm,
                            on_requeue=slurm.lift_hold)
    began = time.monotonic()
    if during:  # something done to the supervisor from outside while it runs (a signal, say)
        threading.Thread(target=during, args=(supervisor,), daemon=True).start()
    code = supervisor.run()
    log = tmp_path / "srun.log"
    starts = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    # Each start's heartbeat gaps (a measurement, not a decision): asserted where they are the point.
    events = [e for e in events if e["event"] != "heartbeat_gaps"]
    return code, starts, events, slurm, time.monotonic() - began


def test_a_lost_node_is_replaced_by_the_spare_inside_the_job(tmp_path, monkeypatch):
    code, starts, events, slurm, took = supervised(tmp_path, monkeypatch, ["n1", "n2", "n3"], 2,
                                                   {"1": {"lose": "n2", "seconds": 1, "trains": True}})
    assert code == 0
    assert [s["nodes"] for s in starts] == [["n1", "n2"], ["n1", "n3"]]
    assert all("--overlap" in s["argv"] for s in starts)
    assert slurm.lifted == []  # a spare took over: no requeue
    assert [(node, "run run-1" in reason and "job 77" in reason) for node, reason in slurm.downed] == [("n2", True)]
    assert [e["event"] for e in events] == ["start", "node_lost", "restart", "start", "end"]
    assert took < 15  # noticed after the 2 s heartbeat timeout, not after srun's 60 s wait
    # A template step per node of the allocation: the lost node's gone with it, the survivor's and the
    # spare's still there for the start on the spare (a step over all three died with the lost node).
    # The spare's was started once training had begun, before the loss.
    warm_steps = [json.loads(line) for line in (tmp_path / "warm.log").read_text().splitlines()]
    assert sorted(step["nodes"] for step in warm_steps) == [["n1"], ["n2"], ["n3"]]
    assert [step["nodes"] for step in warm_steps if step["time"] < starts[1]["time"]][-1] == ["n3"]
    assert [s["warm"] for s in starts] == ["1", "1"]


def test_a_crashed_node_is_lost_within_two_seconds_and_a_quiet_one_that_answers_is_not(tmp_path, monkeypatch):
    """n2 crashes at the start (one heartbeat, then nothing; its slurmd gone): lost within QUIET_S and
    a probe, whatever the 10 s heartbeat timeout. In the second run n2 goes quiet for 3.3 s (its
    heartbeats dropped, its slurmd answering): it keeps its place."""
    code, starts, events, _, _ = supervised(tmp_path, monkeypatch, ["n1", "n2", "n3"], 2,
                                            {"1": {"lose": "n2", "seconds": 3}}, heartbeat_timeout=10)
    start, lost = events[0], next(e for e in events if e["event"] == "node_lost")
    assert code == 0 and lost["node"] == "n2" and "slurmd does not answer" in lost["reason"]
    # From the start (the fake srun's own start-up included, slow on a loaded machine): far inside
    # the 10 s timeout. The lab's tests and benchmarks/recovery.py time it from the crash.
    assert lost["time"] - start["time"] < 5.0
    for used in ("srun.log", "events.jsonl"):
        (tmp_path / used).unlink()
    code, starts, events, slurm, _ = supervised(tmp_path, monkeypatch, ["n1", "n2", "n3"], 2,
                                                {"1": {"mute": "n2", "mute_for": 3.3, "seconds": 4}},
                                                heartbeat_timeout=10)
    assert code == 0 and len(starts) == 1 and slurm.downed == [] and "node_lost" not in [e["event"] for e in events]
    (gaps,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()
               if '"heartbeat_gaps"' in line]
    assert gaps["longest"]["n2"] >= 3 > gaps["longest"]["n1"]  # n2's beats lost for 3 s: measured, and survived


def test_a_node_with_no_address_slurm_knows_waits_for_the_timeout(tmp_path, monkeypatch):
    """No NodeAddr from Slurm and a name that does not resolve: nothing to probe, so no sign of loss;
    its silence counts only at the heartbeat timeout (here 3 s), never after a second."""
    code, starts, events, _, _ = supervised(tmp_path, monkeypatch, ["n1", "unlisted", "n3"], 2,
                                            {"1": {"lose": "unlisted", "seconds": 6}}, heartbeat_timeout=3)
    start, lost = events[0], next(e for e in events if e["event"] == "node_lost")
    assert lost["node"] == "unlisted" and lost["reason"] == "no heartbeat for 3 s"
    assert 3 <= lost["time"] - start["time"] < 5


def test_a_node_that_crashed_as_the_step_failed_is_lost_not_started_on_again(tmp_path, monkeypatch):
    """A crash breaks the other nodes' collectives at once: the step fails before the node's silence
    is long enough to judge. The node that said no goodbye and whose slurmd does not answer is lost
    all the same, and the restart goes to the spare, not back to it."""
    code, starts, events, slurm, _ = supervised(tmp_path, monkeypatch, ["n1", "n2", "n3"], 2,
                                                {"1": {"lose": "n2", "exit": 1, "seconds": 0.2, "linger": 0}})
    assert code == 0 and [s["nodes"] for s in starts] == [["n1", "n2"], ["n1", "n3"]]
    assert [node for node, _ in slurm.downed] == ["n2"]
    assert [e.get("after") for e in events if e["event"] == "restart"] == ["node_lost"]


def test_a_node_that_keeps_hanging_is_drained_and_left_out_for_the_spare(tmp_path, monkeypatch):
    """Two hangs blamed on n2 (a rank of it stopped): the first restarts on the same nodes, the
    second drains n2 with the reason and the run goes on on the spare. A hang that blames no node
    counts against none."""
    plan = {"1": {"exit": 6, "hung_on": ["n2"], "seconds": 0.3}, "2": {"exit": 6, "seconds": 0.3},
            "3": {"exit": 6, "hung_on": ["n1", "n2"], "seconds": 0.3},
            "4": {"exit": 6, "hung_on": ["n2"], "seconds": 0.3}}
    # A blame left by an earlier job start with the same job id and start number (a requeue keeps
    # both): not this start's, never counted.
    (tmp_path / "events.jsonl").write_text(json.dumps({"time": 1.0, "job": "77", "event": "rank_hung", "node": "n2",
                                                       "rank": 1, "start": 1, "blamed": "stopped"}) + "\n")
    code, starts, events, slurm, _ = supervised(tmp_path, monkeypatch, ["n1", "n2", "n3"], 2, plan, max_restarts=5)
    # Start 3's hang blames both nodes alike (a shared filesystem stalling everyone): it counts for none.
    assert code == 0 and [s["nodes"] for s in starts] == [["n1", "n2"]] * 4 + [["n1", "n3"]]
    ((node, reason),) = slurm.drains_made
    assert node == "n2" and "hung 2 times, last: rank 1 stopped" in reason and "run run-1" in reason
    assert slurm.downed == []  # alive: drained for an admin to look, not marked DOWN
    (lost,) = [e for e in events if e["event"] == "node_lost"]
    assert lost["node"] == "n2" and lost["drained_by_ft"] and not lost["marked_down"]


def test_a_node_that_keeps_hanging_with_no_spare_is_handed_back_for_a_requeue_without_it(tmp_path, monkeypatch):
    from toolkit.runs import exits

    plan = {str(start): {"exit": 6, "hung_on": ["n1"], "seconds": 0.3} for start in (1, 2)}
    code, starts, events, slurm, _ = supervised(tmp_path, monkeypatch, ["n1", "n2"], 2, plan,
                                                exclude_after_hangs=2)
    assert code == exits.NODES_LOST and len(starts) == 2 and [n for n, _ in slurm.drains_made] == ["n1"]
    assert events[-1]["event"] == "end" and events[-1]["lost"] == ["n1"]


def test_the_batch_host_waits_as_the_last_spare(tmp_path, monkeypatch):
    """Its loss is a requeue whatever the spares (the job script dies with it): training nodes fail
    first, and are replaced inside the job. Each start's nodes in the allocation's order (srun's
    task order: task 0's node is the rendezvous)."""
    from toolkit.job import supervise

    monkeypatch.setattr(supervise, "reachable_address", lambda node, peers: "127.0.0.1")  # n1 has no address here
    code, starts, events, _, _ = supervised(tmp_path, monkeypatch, ["n1", "n2", "n3"], 2,
                                            {"1": {"lose": "n3", "seconds": 1}}, batch_host="n1")
    assert code == 0
    assert [s["nodes"] for s in starts] == [["n2", "n3"], ["n1", "n2"]]
    assert [e["spares"] for e in events if e["event"] == "start"] == [["n1"], []]


def test_a_template_that_failed_is_started_again_with_the_next_start(tmp_path, monkeypatch):
    code, starts, _, _, _ = supervised(tmp_path, monkeypatch, ["n1", "n2", "n3"], 2,
                                       {"1": {"lose": "n2", "seconds": 1}, "warm_fails": ["n1"]})
    assert code == 0 and [s["nodes"] for s in starts] == [["n1", "n2"], ["n1", "n3"]]
    warm_steps = [json.loads(line)["nodes"] for line in (tmp_path / "warm.log").read_text().splitlines()]
    # The first start's nodes; at the restart n1's again (it had failed) and the spare's (no step was
    # reported before the loss, so it was not started yet).
    assert sorted(warm_steps[:2]) == [["n1"], ["n2"]] and sorted(warm_steps[2:]) == [["n1"], ["n3"]]


def test_a_lost_node_without_a_spare_is_handed_back_for_a_requeue(tmp_path, monkeypatch):
    from toolkit.runs import exits

    code, starts, events, slurm, _ = supervised(tmp_path, monkeypatch, ["n1", "n2"], 2, {"1": {"lose": "n1"}})
    assert code == exits.NODES_LOST and len(starts) == 1
    assert slurm.lifted == ["77"]  # once, though both the loss and the hand-back ask for it
    assert events[-1]["event"] == "end" and events[-1]["lost"] == ["n1"]


def test_a_failed_start_restarts_on_the_same_nodes_and_user_errors_do_not(tmp_path, monkeypatch):
    code, starts, events, slurm, _ = supervised(tmp_path, monkeypatch, ["n1", "n2"], 2,
                                                {"1": {"exit": 1, "seconds": 0.5}})
    assert code == 0 and [s["nodes"] for s in starts] == [["n1", "n2"]] * 2 and slurm.downed == []
    assert [e.get("after") for e in events if e["event"] == "restart"] == ["exit 1"]

    for used in ("srun.log", "events.jsonl"):
        (tmp_path / used).unlink()
    code, starts, _, _, _ = supervised(tmp_path, monkeypatch, ["n1", "n2"], 2, {"1": {"exit": 4, "seconds": 0.5}})
    assert code == 4 and len(starts) == 1


@pytest.mark.parametrize("most", [0, 1])
def test_restarts_stop_at_max_restarts(tmp_path, monkeypatch, most):
    plan = {str(start): {"exit": 3, "seconds": 0.3} for start in range(1, 5)}
    code, starts, _, _, _ = supervised(tmp_path, monkeypatch, ["n1"], 1, plan, max_restarts=most)
    assert code == 3 and len(starts) == most + 1


def test_under_hyperpods_auto_resume_the_watchdog_only_watches(tmp_path, monkeypatch):
    """HyperPod replaces the node and restarts the step itself: ft stopping it too would restart twice."""
    code, starts, events, slurm, _ = supervised(tmp_path, monkeypatch, ["n1", "n2", "n3"], 2,
                                                {"1": {"lose": "n2", "seconds": 1, "linger": 4}},
                                                srun_options=["--auto-resume=1"])
    assert code == 0 and len(starts) == 1 and slurm.downed == []
    assert [e["event"] for e in events] == ["start", "node_silent", "end"]


def test_a_node_drained_under_the_job_is_left_out_for_the_spare(tmp_path, monkeypatch):
    code, starts, events, slurm, _ = supervised(tmp_path, monkeypatch, ["n1", "n2", "n3"], 2,
                                                {"1": {"seconds": 30}, "2": {"seconds": 1}}, drains={"n2": 1})
    assert code == 0 and [s["nodes"] for s in starts] == [["n1", "n2"], ["n1", "n3"]]
    assert slurm.downed == []  # a drain is someone else's, reason and all
    lost = [e for e in events if e["event"] == "node_lost"]
    assert lost[0]["node"] == "n2" and "XID 79" in lost[0]["reason"]


def test_junk_bytes_stop_neither_the_supervisors_reader_nor_a_launchers_heartbeat():
    receiver = Receiver(SECRET, host="127.0.0.1").listen()
    sender = Sender("127.0.0.1", receiver.port, SECRET, "node1", receiver.next_start(), state=dict).start()
    time.sleep(1.3)  # its first heartbeat binds the launcher's socket
    attacker = __import__("socket").socket(__import__("socket").AF_INET, __import__("socket").SOCK_DGRAM)
    for junk in (b"\xff", b"\xff" * 64 + b" {}", b"a" * 64 + b" \xff\xfe", b" "):
        attacker.sendto(junk, ("127.0.0.1", receiver.port))
        attacker.sendto(junk, ("127.0.0.1", sender.socket.getsockname()[1]))
    time.sleep(3.5)
    assert receiver.seen()["node1"].seq >= 3 and sender.thread.is_alive() and sender.answered_seq >= 2
    sender.stop(0)
    receiver.close()


def test_answers_keep_coming_while_the_supervisor_waits_on_a_slow_slurm():
    receiver = Receiver(SECRET, host="127.0.0.1").listen()
    silences = []
    sender = Sender("127.0.0.1", receiver.port, SECRET, "node2", receiver.next_start(), state=dict, silence_s=1.5,
                    on_silence=silences.append).start()
    time.sleep(4)  # what a sinfo that takes 4 s does to the supervisor's own loop
    sender.stop(0)
    receiver.close()
    assert silences == []


def test_a_stop_signal_in_the_restart_pause_is_not_lost(tmp_path, monkeypatch):
    def signal_in_the_pause(supervisor):
        events = tmp_path / "events.jsonl"
        wait_until = time.monotonic() + 20
        # The first restart is at once; the second after a second's pause.
        while time.monotonic() < wait_until and not (
                events.exists() and events.read_text().count('"event": "restart"') == 2):
            time.sleep(0.05)
        supervisor.on_signal(15, None)

    code, starts, events, _, _ = supervised(tmp_path, monkeypatch, ["n1"], 1, {"1": {"exit": 1, "seconds": 0.3},
                                                                              "2": {"exit": 1, "seconds": 0.3}},
                                            during=signal_in_the_pause)
    from toolkit.runs import exits

    assert code == exits.STOPPED and len(starts) == 2  # no new start after the signal


def test_a_finished_run_is_never_restarted_and_a_quiet_node_at_a_success_is_not_lost(tmp_path, monkeypatch):
    (tmp_path / "done").write_text("120\n")  # written by rank 0 after the export
    code, starts, _, _, _ = supervised(tmp_path, monkeypatch, ["n1"], 1, {"1": {"exit": 1, "seconds": 0.3}})
    assert code == 0 and starts == []
    (tmp_path / "done").unlink()
    for used in ("events.jsonl",):
        (tmp_path / used).unlink()
    code, starts, events, slurm, _ = supervised(tmp_path, monkeypatch, ["n1", "n2", "n3"], 2,
                                                {"1": {"lose": "n2", "seconds": 0.3, "linger": 0.5}})
    assert code == 0 and len(starts) == 1 and slurm.downed == []


def test_the_supervisors_own_verdict_is_what_the_job_script_reads(tmp_path, monkeypatch):
    from toolkit.runs import exits

    code, _, _, _, _ = supervised(tmp_path, monkeypatch, ["n1", "n2"], 2, {"1": {"lose": "n2"}})
    assert code == exits.NODES_LOST and RunLayout(tmp_path).read_exit_status() == exits.NODES_LOST
    (tmp_path / "exit-status").write_text("²\n")
    assert RunLayout(tmp_path).read_exit_status() is None


def test_a_step_that_did_not_start_on_every_node_goes_back_to_the_job_script(tmp_path, monkeypatch):
    """srun could not launch on n2 (a node lost between allocation and launch): the job script
    tells a lost node from a refusal (tests/unit/test_job_script_launch.py), not the supervisor."""
    code, starts, events, slurm, _ = supervised(tmp_path, monkeypatch, ["n1", "n2"], 2,
                                                {"1": {"unstarted": "n2", "exit": 233, "seconds": 0.5}})
    assert code == 233 and len(starts) == 1 and slurm.downed == []  # n1's launcher, killed, is not lost
    assert events[-1]["nodes"] == ["n2"]


def test_a_step_srun_says_did_not_launch_everywhere_is_handed_back_without_srun_s_wait(tmp_path, monkeypatch):
    """After a launch failure srun waits KillWait + 2 s for the lost node's part of the step, which
    never answers: meanwhile Slurm may find the node lost itself and requeue the job, without ft's
    reason on the node. The supervisor hands the start back as soon as srun says so."""
    code, starts, events, _, took = supervised(tmp_path, monkeypatch, ["n1", "n2"], 2, {
        "1": {"unstarted": "n2", "launch_fails": 30, "exit": 233}})
    assert code == 1 and len(starts) == 1 and took < 15
    assert events[-1]["why"] == "the step did not start on every node" and events[-1]["nodes"] == ["n2"]


class RecordedExporter:
    """Stands in for the run's metrics exporter: records how long its stop would wait."""

    def __init__(self):
        self.waits = []

    def stop(self, final_wait_s=None):
        self.waits.append(final_wait_s)


@pytest.mark.parametrize("plan, max_restarts, final", [
    ({"1": {"seconds": 0.3}}, 3, True),  # finished
    ({"1": {"exit": 4, "seconds": 0.3}}, 3, True),  # a user error: failed for good
    ({"1": {"exit": 3, "seconds": 0.3}}, 0, True),  # restarts spent: failed for good
    ({"1": {"exit": 5, "seconds": 0.3}}, 3, False),  # out of memory: the job script retries at once
    ({"1": {"unstarted": "n2", "exit": 233, "seconds": 0.3}}, 3, False),  # a node lost at launch: requeued
])
def test_the_last_scrape_is_waited_for_only_at_the_runs_end_for_good(tmp_path, monkeypatch, plan, max_restarts,
                                                                      final):
    """Waiting up to a scrape interval for Prometheus's last look holds up the job script: when it has
    more to do (requeue without a node lost at launch before Slurm notices the node itself), no wait."""
    from toolkit.job.supervise import Supervisor

    exporter = RecordedExporter()
    monkeypatch.setattr(Supervisor, "start_exporter", lambda self: exporter)
    supervised(tmp_path, monkeypatch, ["n1", "n2"], 2, plan, max_restarts=max_restarts)
    assert exporter.waits == [None if final else 0]


def test_a_metrics_exporter_that_fails_unforeseen_turns_monitoring_off_not_the_run(tmp_path, monkeypatch, capfd):
    """supervise.py's blind except around the exporter: its start failing in a way nobody foresaw (not
    a missing prometheus_client nor a port taken) is said, and the run goes on to its end without
    metrics (narrowed to OSError, this test fails: checked)."""
    from toolkit.watch import metrics

    class Unforeseen(Exception):
        pass

    class BrokenExporter:
        def __init__(self, *args, **kwargs):
            raise Unforeseen("the exporter broke in a way nobody foresaw")

    monkeypatch.setattr(metrics, "RunExporter", BrokenExporter)
    code, starts, events, _, _ = supervised(tmp_path, monkeypatch, ["n1", "n2"], 2, {"1": {"seconds": 0.3}})
    assert code == 0 and len(starts) == 1 and events[-1]["event"] == "end"
    out, _ = capfd.readouterr()
    assert "no Prometheus metrics for this run: Unforeseen: the exporter broke in a way nobody foresaw" in out


FLOODER = """
import socket, sys, time
target, until = ("127.0.0.1", int(sys.argv[1])), time.monotonic() + float(sys.argv[2])
flood = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
junk = b"x" * 512
while time.monotonic() < until:
    for _ in range(256):
        try:
            flood.sendto(junk, target)
        except OSError:
            pass
"""


def flooding(port: int, seconds: float, senders: int = 3) -> list[subprocess.Popen]:
    """Junk datagrams from the job node's own address (127.0.0.1 here), as fast as Python sends."""
    return [subprocess.Popen([sys.executable, "-c", FLOODER, str(port), str(seconds)]) for _ in range(senders)]


def test_a_flood_from_a_job_nodes_own_address_is_refused_cheaply_and_counted():
    receiver = Receiver(SECRET, host="127.0.0.1", sources={"127.0.0.1"}).listen()
    sender = Sender("127.0.0.1", receiver.port, SECRET, "node1", receiver.next_start(), state=dict).start()
    flooders = flooding(receiver.port, 4)
    for flooder in flooders:
        flooder.wait(timeout=30)
    refused, sources = receiver.flood(10)
    time.sleep(2.5)
    sender.stop(0)
    receiver.close()
    # Here the three senders outrun the reader on two cores and the kernel drops the heartbeats with
    # the junk: what the supervisor does about such a silence is the next test's.
    assert refused > FLOOD_DATAGRAMS and sources == ["127.0.0.1"]
    assert receiver.seen()["node1"].seq >= 2  # the reader kept going: the beats after the flood are heard


@pytest.mark.parametrize("slurm_says", ["answers", "does not answer"])
def test_a_node_silent_under_a_flood_is_lost_only_on_slurms_word(tmp_path, monkeypatch, slurm_says):
    """Three senders flood the supervisor from a job node's own address while n2's heartbeats are
    lost for 4 s (twice the timeout), as the kernel drops them in a flood: no loss while Slurm says
    its slurmd answers; lost, and replaced by the spare, where Slurm says it does not."""
    def flood(supervisor):
        if slurm_says != "answers":
            supervisor.slurm.not_answering.add("n2")
        time.sleep(0.5)
        for flooder in flooding(supervisor.receiver.port, 6):
            flooder.wait(timeout=30)

    plan = {"1": {"seconds": 8, "mute": "n2", "mute_after": 1.5, "mute_for": 4, "trains": True},
            "2": {"seconds": 1}}
    code, starts, events, slurm, _ = supervised(tmp_path, monkeypatch, ["n1", "n2", "n3"], 2, plan, during=flood)
    assert code == 0
    lost = [event for event in events if event["event"] == "node_lost"]
    if slurm_says == "answers":
        assert lost == [] and len(starts) == 1 and slurm.downed == []
        [said] = [event for event in events if event["event"] == "heartbeat_flood"]
        assert "n2" in said["silent"] and said["refused"] >= FLOOD_DATAGRAMS  # n1's beats may drop too
    else:
        assert [event["node"] for event in lost] == ["n2"] and [s["nodes"] for s in starts][1] == ["n1", "n3"]


def test_junk_from_outside_the_job_is_no_flood_and_slurm_silent_is_no_word():
    """Refusals from addresses that are not the job's do not excuse a silence (anyone could send
    them); and where sinfo fails, a silent node is not taken as answering."""
    from toolkit.base.errors import FtError
    from toolkit.job.supervise import Supervisor

    receiver = Receiver(SECRET, host="127.0.0.1", sources={"10.9.9.9"}).listen()
    for flooder in flooding(receiver.port, 1, senders=1):
        flooder.wait(timeout=30)
    assert receiver.refused > FLOOD_DATAGRAMS and receiver.flood(10) == (0, [])
    receiver.close()

    class Failing:
        def unresponsive(self, nodes):
            raise FtError("sinfo: Unable to contact slurm controller")

    supervisor = Supervisor.__new__(Supervisor)  # only what flood_checked reads
    supervisor.receiver = type("Flooded", (), {"flood": lambda self, window: (50_000, ["10.0.0.7"])})()
    supervisor.slurm, supervisor.flood_said, supervisor.slurm_answer = Failing(), False, (float("-inf"), {})
    assert supervisor.flood_checked(["n1"], 10) == ["n1"]
