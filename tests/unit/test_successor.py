"""A lost batch host's job goes on (toolkit/launch/handover.py, toolkit/job/successor.py,
toolkit/job/adopted.py): the launcher that reports the loss marks the node DOWN and starts a
successor, every launcher retargets its heartbeats to it, and the successor's supervisor adopts
the training step as it runs. Real heartbeats on loopback, real files; Slurm is a stand-in here
(tests/lab/test_recovery.py crashes a real batch host under a real job)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.support.run_specs import run_spec, write_run_spec
from tests.unit.test_watch import FAKE_SRUN, SECRET, FakeSlurm
from toolkit.job.adopted import AdoptedStep, StepListing
from toolkit.launch.handover import Handover, successor_node, wait_for_handover
from toolkit.slurm import steps
from toolkit.slurm.client import JobInfo
from toolkit.watch.heartbeat import Receiver, Sender


class StepsSlurm(FakeSlurm):
    """FakeSlurm with the job's steps, scancel's signals, and the job's own nodes."""

    def __init__(self, nodes: list[str], steps_now: dict[str, list[str]]):
        super().__init__(nodes)
        self.steps_now, self.signals, self.listings = steps_now, [], 0

    def job_steps(self, job_id: str) -> dict[str, list[str]]:
        self.listings += 1
        return dict(self.steps_now)

    def signal_step(self, step_id: str, signal_name: str) -> bool:
        self.signals.append((step_id, signal_name))
        if signal_name in ("KILL", "TERM"):
            self.steps_now.pop(step_id, None)
        return True

    def job_brief(self, job_id: str) -> JobInfo:
        return JobInfo(job_id, "RUNNING", "scontrol", nodes=self.job_nodes)

    job_nodes = "n1,n2,n3"  # the job's nodes as Slurm has them now

    def hostnames(self, nodelist: str) -> list[str]:
        return nodelist.split(",") if "," in nodelist else self.nodes


def test_an_adopted_step_ends_with_its_launchers_goodbyes_or_when_slurm_no_longer_lists_it():
    slurm = StepsSlurm(["n1", "n2"], {"77.2": ["n1", "n2"]})
    listing, said = StepListing(slurm, "77"), {}
    step = AdoptedStep(slurm, listing, "77.2", ["n1", "n2"], goodbyes=lambda: dict(said))
    assert step.poll() is None
    said["n1"] = 0
    assert step.poll() is None  # one node still trains
    said["n2"] = 4
    assert step.poll() == 4  # the failure a launcher said, as srun would report it
    # Slurm asked at most once a second, however often the step is polled.
    for _ in range(50):
        listing.running("77.2")
    assert slurm.listings == 1

    gone = AdoptedStep(slurm, StepListing(slurm, "77"), "77.3", ["n1"])
    assert gone.poll() == 1  # not listed, no goodbye: killed before it could say one


def until(condition, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.01)


def test_an_adopted_step_is_signalled_as_srun_passes_signals_on_and_two_interrupts_kill_it():
    slurm = StepsSlurm(["n1", "n2"], {"77.2": ["n1", "n2"]})
    step = AdoptedStep(slurm, StepListing(slurm, "77"), "77.2", ["n1", "n2"])
    step.send_signal(signal.SIGUSR2)
    step.send_signal(signal.SIGINT)  # srun's first interrupt only reports
    until(lambda: slurm.signals == [("77.2", "USR2")])  # sent from a thread: scancel may wait on Slurm
    step.send_signal(signal.SIGINT)
    until(lambda: slurm.signals[-1] == ("77.2", "KILL"))
    step.listing.asked = float("-inf")  # a second later
    assert step.wait(timeout=2) == 1
    slurm.steps_now["77.4"] = ["n1", "n3"]  # n3 lost: Slurm lists the step until it cleans it up
    stuck = AdoptedStep(slurm, StepListing(slurm, "77"), "77.4", ["n1", "n3"])
    with pytest.raises(subprocess.TimeoutExpired):
        stuck.wait(timeout=0.3)
    slurm.signal_step = lambda step_id, name: True  # the KILL sent; the step still listed
    began = time.monotonic()
    stuck.kill()
    assert stuck.wait(timeout=5) == -signal.SIGKILL and time.monotonic() - began < 2  # as a killed srun


def test_the_successors_word_is_read_whole_and_only_for_the_node_it_succeeds(tmp_path):
    Handover("n3", "n4", "10.0.0.4", 4242).write(tmp_path)
    assert Handover.read(tmp_path, "n3") == Handover("n3", "n4", "10.0.0.4", 4242)
    assert Handover.read(tmp_path, "n1") is None
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial file left
    Handover.path(tmp_path, "n5").write_text(json.dumps({"lost": "n5", "node": "n4", "address": "x", "port": 0}))
    Handover.path(tmp_path, "n6").write_text('{"lost": "n6", "node"')  # cut short
    assert Handover.read(tmp_path, "n5") is None and Handover.read(tmp_path, "n6") is None
    # A successor whose srun ended without a word: not waited for.
    began = time.monotonic()
    assert wait_for_handover(tmp_path, "n7", alive=lambda: False, wait_s=10) is None
    assert time.monotonic() - began < 1


def test_the_successor_goes_to_a_spare_and_to_the_reporter_when_none_is_left():
    slurm = LauncherSlurm("n1,n2,n4")  # the job's nodes now: n1, n2 (training), n4 (a spare)
    assert successor_node(slurm, "77", ["n1", "n2"], "n3", "n2") == "n4"
    assert successor_node(slurm, "77", ["n1", "n2", "n4"], "n3", "n2") == "n2"
    drained = LauncherSlurm("n1,n2,n4,n5", drained=("n4",))  # a node ft drained as hung: not a spare
    assert successor_node(drained, "77", ["n1", "n2"], "n3", "n2") == "n5"


def test_the_successors_step_shares_its_node_and_binds_no_cpus():
    argv = steps.successor_step("77", "n4", ["python", "-m", "toolkit.job"])
    assert argv[:3] == ["srun", "--jobid=77", "--nodelist=n4"]
    assert {"--overlap", "--cpu-bind=none", "--input=none", "--nodes=1", "--ntasks=1"} <= set(argv)
    assert argv[-3:] == ["python", "-m", "toolkit.job"]


def adoption_env(tmp_path: Path, monkeypatch, node: str = "localhost") -> None:
    (tmp_path / "marks").mkdir(exist_ok=True)
    srun = tmp_path / "srun"
    srun.write_text(f"#!{sys.executable}\n{FAKE_SRUN}")
    srun.chmod(0o755)
    (tmp_path / "plan.json").write_text("{}")
    for name, value in {"FT_JOB_SECRET": SECRET.decode(), "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "x",
                        "SLURMD_NODENAME": node, "SLURM_STEP_ID": "5", "FT_RUN_ID": "run-1",
                        "FT_LAUNCH_MARKS": str(tmp_path / "marks"), "FAKE_PLAN": str(tmp_path / "plan.json"),
                        "FAKE_LOG": str(tmp_path / "srun.log"),
                        "PYTHONPATH": str(Path(__file__).resolve().parents[2])}.items():
        monkeypatch.setenv(name, value)


def test_a_successor_adopts_the_running_step_and_hears_its_launchers_to_the_end(tmp_path, monkeypatch):
    """The lost batch host n3 was the spare: training on n1, n2 goes on. The successor's supervisor
    writes where it listens, hears the launchers of the start the batch host began, starts no step
    of its own, keeps the templates that run, and ends as the step does."""
    from toolkit.job.supervise import Adoption, Supervisor

    write_run_spec(tmp_path, run_spec(2, {"heartbeat_timeout": 2, "startup_timeout": 30}))
    adoption_env(tmp_path, monkeypatch)
    steps_now = {"77.2": ["n1", "n2"], "77.0": ["n1"], "77.1": ["n2"], "77.5": ["localhost"]}  # 77.5: its own
    slurm = StepsSlurm(["n1", "n2", "n3"], steps_now)
    supervisor = Supervisor([str(tmp_path / "srun"), "python", "-m", "toolkit.launch"], tmp_path, slurm,
                            adoption=Adoption("n3", "77.2", ["n1", "n2"], 4))
    outcome: list[int] = []
    running = threading.Thread(target=lambda: outcome.append(supervisor.run()), daemon=True)
    running.start()
    found = wait_for_handover(tmp_path / "marks", "n3", wait_s=10)
    assert found is not None and found.node == "localhost" and found.port == supervisor.receiver.port
    senders = [Sender("127.0.0.1", found.port, SECRET, node, 4, state=dict) for node in ("n1", "n2")]
    for _ in range(4):
        for sender in senders:
            sender.send()
        time.sleep(0.25)
    for sender in senders:
        sender.read_answers()
        assert sender.answered is not None  # the successor answers the launchers of start 4
        sender.exit_code = 0
        sender.send()
    running.join(timeout=10)
    assert outcome == [0] and supervisor.excluded == ["n3"]
    assert not (tmp_path / "srun.log").exists()  # no training step started: the running one was adopted
    assert set(supervisor.warm) == {"n1", "n2"} and all(isinstance(s, AdoptedStep) for s in supervisor.warm.values())
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    (took,) = [e for e in events if e["event"] == "took_over"]
    assert took["lost"] == "n3" and took["step"] == "77.2" and took["start"] == 4
    assert events[-1]["event"] == "end" and events[-1]["code"] == 0


def test_a_successor_leaves_out_what_its_batch_host_left_out_and_what_slurm_took_from_the_job(tmp_path,
                                                                                               monkeypatch):
    from toolkit.job.supervise import Adoption, Supervisor
    from toolkit.runs.layout import EXCLUDED

    write_run_spec(tmp_path, run_spec(2, {"heartbeat_timeout": 2}))
    adoption_env(tmp_path, monkeypatch)
    (tmp_path / "marks" / EXCLUDED).write_text(json.dumps(["n4"]))  # drained as hung by the batch host's
    slurm = StepsSlurm(["n1", "n2", "n3", "n4", "n5", "n6"], {})
    slurm.job_nodes = "n1,n2,n4,n6"  # n5 lost before: Slurm took it out of the job
    supervisor = Supervisor(["srun", "python", "-m", "toolkit.launch"], tmp_path, slurm,
                            adoption=Adoption("n3", "77.2", ["n1", "n2"], 1))
    assert sorted(supervisor.excluded) == ["n3", "n4", "n5"] and supervisor.spares() == ["n6"]
    supervisor.close()


def test_a_retargeted_launcher_judges_the_successors_own_silence_afresh():
    first, second = Receiver(SECRET, host="127.0.0.1"), Receiver(SECRET, host="127.0.0.1")
    start = first.next_start()
    second.adopt_start(start)
    asked = []

    def judge(quiet: float) -> bool:
        asked.append(quiet)
        if len(asked) == 1:  # the batch host lost: a successor took over (node.py returns False then)
            sender.retarget("127.0.0.1", second.port)
            return False
        return True

    sender = Sender("127.0.0.1", first.port, SECRET, "n2", start, state=dict, silence_s=10, on_silence=judge)
    sender.start()
    first.poll(time.monotonic() + 0.6)
    first.close()
    time.sleep(1.6)
    second.poll(time.monotonic() + 1.0)  # the successor answers
    assert len(asked) == 1
    second.close()  # and is lost in turn: its silence is judged too
    time.sleep(1.8)
    sender.stop(0)
    assert len(asked) == 2


class LauncherSlurm:
    def __init__(self, nodes: str = "n1,n2", drained: tuple[str, ...] = ()):
        self.calls, self.nodes, self.drains = [], nodes, drained

    def drained(self, nodes):
        return {node: "ft: hung 2 times" for node in nodes if node in self.drains}

    def mark_node_down(self, node, reason):
        self.calls.append(("down", node))
        return True

    def requeue(self, job):
        self.calls.append(("requeue", job))
        return True

    def job_brief(self, job_id):
        return JobInfo(job_id, "RUNNING", "scontrol", nodes=self.nodes)

    def hostnames(self, nodelist):
        return nodelist.split(",")

    def unresponsive(self, nodes):
        return nodes


@pytest.fixture
def launcher(tmp_path, monkeypatch):
    from toolkit.launch import node

    slurm = LauncherSlurm()
    monkeypatch.setattr("toolkit.slurm.client.CliSlurmClient", lambda: slurm)
    monkeypatch.setattr(node, "REQUEUED_AT", [])
    monkeypatch.setattr(node, "SILENT_AFTER", [])
    monkeypatch.setattr(node, "SUCCESSORS", [])
    monkeypatch.setattr(node, "WATCHED", node.Watched("", ""))
    monkeypatch.setattr(node, "slurmd_answers", lambda address: False)
    (tmp_path / "marks").mkdir()
    (tmp_path / "logs").mkdir()
    for name, value in {"FT_WATCH_NODE": "n3", "FT_WATCH_ADDR": "10.0.0.3", "FT_WATCH_NODES": "n1,n2",
                        "FT_WATCH_START": "1", "SLURM_JOB_ID": "41", "SLURM_STEP_ID": "2", "FT_RUN_ID": "run-1",
                        "FT_RUN_DIR": str(tmp_path), "FT_LAUNCH_MARKS": str(tmp_path / "marks")}.items():
        monkeypatch.setenv(name, value)
    return node, slurm


def test_the_reporter_marks_a_lost_spare_batch_host_down_and_every_launcher_follows_its_successor(
        tmp_path, monkeypatch, launcher):
    node, slurm = launcher
    started = []

    def start_successor(job, where, lost, step, start, training, log_to):
        started.append((job, where, lost, step, start, training))
        Handover(lost, where, "127.0.0.1", 5555).write(tmp_path / "marks")  # the successor's word, at once
        clients.append(subprocess.Popen(["sleep", "30"]))  # its srun client
        return clients[-1]

    clients: list[subprocess.Popen] = []

    monkeypatch.setattr("toolkit.launch.handover.start_successor", start_successor)
    receiver = Receiver(SECRET)
    first = Sender("127.0.0.1", receiver.port, SECRET, "n2", 1, state=dict)
    other = Sender("127.0.0.1", receiver.port, SECRET, "n1", 1, state=dict)
    # False: judged, but a later silence (the successor's own loss) is asked about afresh.
    assert node.batch_host_lost("n2", 1.2, sender=first) is False
    assert slurm.calls[0] == ("down", "n3") and ("requeue", "41") not in slurm.calls  # the job goes on
    assert started == [("41", "n2", "n3", "41.2", "1", ["n1", "n2"])]  # no spare left: on the reporter
    # Its srun client kept (Slurm ends a step whose client goes away on a live node): the launcher
    # waits for it as it ends.
    assert clients[0].poll() is None and clients == node.SUCCESSORS
    clients[0].kill()
    node.wait_for_successor()
    assert first.target == ("127.0.0.1", 5555) and not node.REQUEUED_AT
    node.WATCHED.node = ""  # the other launcher is another process: it has not retargeted yet
    assert node.batch_host_lost("n1", 1.3, sender=other) is False  # not the first: it follows
    assert other.target == ("127.0.0.1", 5555) and len(started) == 1
    events = [json.loads(line)["event"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events == ["node_lost", "successor"]
    receiver.close()


def test_a_late_successor_stands_down_once_the_reporter_gave_up_and_one_that_claimed_first_is_waited_for(
        tmp_path, monkeypatch, launcher):
    from toolkit.job import successor
    from toolkit.launch import handover

    node, slurm = launcher
    marks = tmp_path / "marks"
    assert handover.claim(marks, "n3", "abandoned") and not handover.claim(marks, "n3", "successor")
    monkeypatch.setattr(successor, "JobController", lambda *args, **kwargs: pytest.fail("it must not take over"))
    monkeypatch.setattr(successor, "write_batch_log", lambda run_dir, job_id: None)
    assert successor.main(["--successor-of", "n3", "--step", "41.2", "--start", "1", "--training", "n1,n2"]) == 0
    assert not Handover.path(marks, "n3").exists()

    # The successor claimed before the reporter's wait ran out: it is given a while more.
    monkeypatch.setattr(handover, "HANDOVER_WAIT_S", 0.5)
    monkeypatch.setattr(handover.wait_for_handover, "__defaults__", (lambda: True, 0.5))

    def slow_successor(job, where, lost, *args):
        handover.claim(marks, lost, "successor")
        threading.Timer(0.7, lambda: Handover(lost, where, "127.0.0.1", 5556).write(marks)).start()
        return subprocess.Popen(["sleep", "30"])

    monkeypatch.setattr(handover, "start_successor", slow_successor)
    monkeypatch.setenv("FT_WATCH_NODE", "n5")
    sender = Sender("127.0.0.1", 9, SECRET, "n2", 1, state=dict)
    assert node.batch_host_lost("n2", 1.2, sender=sender) is False
    assert sender.target == ("127.0.0.1", 5556) and ("requeue", "41") not in slurm.calls


def test_a_successor_that_does_not_come_is_replaced_by_a_requeue(tmp_path, monkeypatch, launcher):
    node, slurm = launcher
    monkeypatch.setattr("toolkit.launch.handover.start_successor",
                        lambda *args: subprocess.Popen(["sh", "-c", "exit 1"]))  # srun refused
    sender = Sender("127.0.0.1", 9, SECRET, "n2", 1, state=dict)
    assert node.batch_host_lost("n2", 1.2, sender=sender) is True
    assert slurm.calls == [("down", "n3"), ("requeue", "41"), ("down", "n3")] and node.REQUEUED_AT
    assert sender.target == ("127.0.0.1", 9)
    assert (tmp_path / "marks" / "succession-of-n3").read_text() == "abandoned"  # a late successor stands down


def test_a_batch_host_that_trains_is_requeued_for_not_succeeded(tmp_path, monkeypatch, launcher):
    node, slurm = launcher
    monkeypatch.setenv("FT_WATCH_NODES", "n3,n2")  # no spare: the batch host trains, and its ranks are gone
    monkeypatch.setattr("toolkit.launch.handover.start_successor", lambda *args: pytest.fail("no successor"))
    assert node.batch_host_lost("n2", 1.2, sender=Sender("127.0.0.1", 9, SECRET, "n2", 1, state=dict)) is True
    assert slurm.calls == [("requeue", "41"), ("down", "n3")]


def test_the_successor_keeps_the_time_limit_itself():
    from toolkit.job import successor

    class Slurm:
        def end_time(self, job_id):
            return time.time() + 0.3  # the limit near: before_s 1 s is already past

    got = []
    successor.time_limit_watch(Slurm(), "41", 1, threading.Event(), got.append)
    assert got == [signal.SIGUSR2]


@pytest.mark.parametrize(("state", "restarts", "ends"), [("RUNNING", 0, True), ("RUNNING", 1, False),
                                                        ("PENDING", 1, False), ("COMPLETING", 0, False)])
def test_the_successor_ends_only_the_start_it_took_over(state, restarts, ends):
    from toolkit.job import successor

    class Slurm:
        def job_brief(self, job_id):
            return JobInfo(job_id, state, "scontrol", restarts=restarts)

    assert successor.still_this_start(Slurm(), "41", 0) is ends


def test_the_successor_writes_the_batch_log_and_parses_its_orders(tmp_path):
    from toolkit.job import successor

    adoption = successor.parse(["--successor-of", "n3", "--step", "41.2", "--start", "4", "--training", "n1,n2"])
    assert (adoption.lost, adoption.step_id, adoption.start, adoption.nodes) == ("n3", "41.2", 4, ["n1", "n2"])
    (tmp_path / "logs").mkdir()
    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
              "from pathlib import Path\nfrom toolkit.job.successor import write_batch_log\n"
              f"write_batch_log(Path({str(tmp_path)!r}), '41'); print('ft: hello'); "
              "print('oops', file=sys.stderr)")
    (tmp_path / "logs" / "slurm-41.out").write_text("ft: the job script's lines\n")
    subprocess.run([sys.executable, "-c", script], check=True, env=dict(os.environ, PYTHONSAFEPATH="1"))
    assert (tmp_path / "logs" / "slurm-41.out").read_text() == "ft: the job script's lines\nft: hello\noops\n"
