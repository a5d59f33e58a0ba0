"""The job on its batch host (toolkit/job/controller.py): what each ending of the training step
costs. The controller runs for real, with its watchdog, against a stand-in srun (a script that
leaves the launch marks of the nodes it "started" and srun's messages for the ones it could not
reach) and a stand-in Slurm client (the only mocks: tests/lab/test_training.py and
tests/lab/test_recovery.py do the same with real Slurm)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from toolkit.job import losses
from toolkit.job.controller import JobController, requeue_backoff
from toolkit.recipe.job_plan import StepPlan
from toolkit.recipe.resolve import resolve
from toolkit.render.sbatch import RunPlacement, render
from toolkit.slurm.client import JobInfo

REPO = Path(__file__).resolve().parents[2]
COMMUNICATION = "Communication connection failure"

# srun: a warm template sleeps; a training step leaves the launch marks of $STARTED nodes, srun's
# message for each $UNREACHED node, the $LEAVE exit status where set, and exits $STATUS (1); with
# $UNTIL_SIGNAL it waits for USR2 or TERM, with $FINISH it finishes the run and lingers that long.
FAKE_SRUN = """#!/bin/bash
case "$*" in *toolkit.launch.warm) exec /bin/sleep 30 ;; esac
echo "$FT_OOM_RETRY" >> "$FT_RUN_DIR/launches"
for node in $STARTED; do touch "$FT_LAUNCH_MARKS/$node"; done
for node in $UNREACHED; do
    echo "srun: error: Task launch for StepId=$SLURM_JOB_ID.0 failed on node $node: $SRUN_ERROR" >&2
done
if [ -n "$LEAVE" ]; then echo "$LEAVE" > "$FT_RUN_DIR/exit-status"; fi
if [ -n "$UNTIL_SIGNAL" ]; then  # the ranks checkpoint on USR2 or TERM, and stop (8)
    trap 'echo 8 > "$FT_RUN_DIR/exit-status"; exit 8' USR2 TERM
    sleep 30 & wait $!
    exit 1
fi
if [ -n "$FINISH" ]; then touch "$FT_RUN_DIR/done"; exec /bin/sleep "$FINISH"; fi
exit "${STATUS:-1}"
"""


class FakeSlurm:
    """Slurm's side of the job. A node marked DOWN, or a requeue, ends the job as Slurm would: TERM
    to the batch step (this process), when `ends_job`."""

    def __init__(self, nodes: list[str], ends_job: bool = True, operator: bool = True,
                 requeues_preempted: bool = False):
        self.nodes, self.ends_job, self.operator = nodes, ends_job, operator
        self.preempted_requeue = requeues_preempted
        self.downed: list[tuple[str, str]] = []
        self.requeued: list[str] = []
        self.lifted: list[tuple[str, int]] = []  # each new begin time asked for: (job, seconds from now)
        self.noticed = False  # Slurm found a node DOWN itself

    def hostnames(self, nodelist: str) -> list[str]:
        return self.nodes

    def mark_node_down(self, node: str, reason: str) -> bool:
        if not self.operator:  # Slurm notices the node itself a while later, and requeues the job
            import threading

            def notice() -> None:
                self.noticed = True
                self.end_job()

            threading.Timer(0.5, notice).start()
            return False
        self.downed.append((node, reason))
        self.end_job()
        return True

    def requeue(self, job_id: str) -> bool:
        self.requeued.append(job_id)
        self.end_job()
        return True

    def end_job(self) -> None:
        if self.ends_job:
            os.kill(os.getpid(), signal.SIGTERM)

    def config_seconds(self, name: str) -> int:
        return {"SlurmdTimeout": 10, "KillWait": 5}[name]

    def node_addresses(self, nodes: list[str]) -> dict[str, str]:
        return {}  # nothing to probe: a silence waits for the heartbeat timeout (the watchdog's, tested apart)

    def slurmd_answers(self, address: str, port: int) -> bool:
        return True

    def config_number(self, name: str) -> None:
        return None  # SlurmdPort unknown: no probe

    def requeues_preempted(self, job_id: str, partition: str) -> bool:
        return self.preempted_requeue

    def job_brief(self, job_id: str) -> JobInfo:
        """Requeued (once asked to, or a node marked DOWN), completing until the job's processes end."""
        requeued = bool(self.requeued or self.downed or self.noticed)
        return JobInfo(job_id, "COMPLETING" if requeued else "RUNNING", "scontrol", restarts=int(requeued))

    def start_after(self, job_id: str, seconds: int) -> bool:
        if not self.lifted or self.lifted[-1] != (job_id, seconds):
            self.lifted.append((job_id, seconds))
        return True

    def job_pids_here(self, job_id: str) -> list[int]:
        return [os.getpid()]  # the job's last process here: the batch script

    def unresponsive(self, nodes: list[str]) -> list[str]:
        return []

    def drained(self, nodes: list[str]) -> dict[str, str]:
        return {}


@pytest.fixture
def job(tmp_path, monkeypatch):
    """Runs the controller on a run of the tiny recipe (3 nodes, node1-3, job 7); returns its exit
    status, its stdout, the run directory and the stand-in Slurm."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    run_dir = tmp_path / "r1"
    run_dir.mkdir(mode=0o700)
    for name in ("MASTER_ADDR", "MASTER_PORT", "FT_JOB_SECRET", "FT_LAUNCH_MARKS", "FT_OOM_RETRY", "LEAVE", "FINISH",
                 "STATUS", "UNTIL_SIGNAL", "SLURM_RESTART_COUNT"):  # what the job sets is undone after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    for name, value in {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7",
                        "SLURM_JOB_NODELIST": "node[1-3]", "SLURM_CPUS_PER_TASK": "2", "SLURMD_NODENAME": "localhost",
                        "FT_RUN_ID": "r1",
                        "FT_RUN_DIR": str(run_dir), "SRUN_ERROR": COMMUNICATION, "STARTED": "node1 node2 node3",
                        "UNREACHED": ""}.items():
        monkeypatch.setenv(name, value)

    def run(watchdog: dict | None = None, slurm: FakeSlurm | None = None, during=None, **srun_env) -> tuple:
        resolved = resolve(REPO / "recipes" / "tiny-lora-sft.yaml", "lab")  # 2 nodes of the 3 allocated
        # The job's decisions are under test, not the watchdog's restarts in place (its backoff).
        for field, value in {"max_restarts": 0, "heartbeat_timeout": 30, **(watchdog or {})}.items():
            setattr(resolved.recipe.watchdog, field, value)
        script = render(resolved, RunPlacement("r1", str(run_dir)), login_python=sys.executable)
        spec = script.split("<<'FT_RECIPE_JSON'\n", 1)[1].split("\nFT_RECIPE_JSON\n", 1)[0]
        (run_dir / "recipe.json").write_text(spec)
        for name, value in srun_env.items():
            monkeypatch.setenv(name, value)
        slurm = slurm or FakeSlurm(["node1", "node2", "node3"])
        controller = JobController(run_dir, slurm)
        previous = {signum: signal.signal(signum, controller.on_signal) for signum in (signal.SIGTERM, signal.SIGUSR2)}
        try:
            if during:
                during(controller)
            code = controller.run()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return code, slurm, run_dir

    return run


def batch_log(capfd) -> str:
    out, err = capfd.readouterr()
    return out + err


def test_an_unreachable_node_is_marked_down_with_the_run_named(job, capfd):
    code, slurm, run_dir = job(STARTED="node1 node3", UNREACHED="node2")
    assert slurm.downed == [("node2", "ft: lost before job 7 (run r1) started on it")]
    assert (run_dir / "launch-failures").read_text() == "7 none node2\n"  # no checkpoint yet
    # The requeue may start at once (the first loss in a row): this process, the job's last here,
    # kept its begin time ahead (1 s and Slurm's margin: requeue.LEAVING_MARGIN_S) as it ended.
    assert slurm.lifted == [("7", 4)]
    assert "requeue_hold_lifted" in (run_dir / "events.jsonl").read_text()
    assert code == 143  # ended by Slurm's requeue (TERM), as it marked the node DOWN
    log = batch_log(capfd)
    assert "node node2 was lost before the step started on it: marking it down" in log
    assert "requeue 1 of at most 3" in log


@pytest.mark.parametrize("error", ["Invalid job credential", "Prolog failed", "Zero Bytes were transmitted"])
def test_a_node_that_refused_the_step_is_not_marked_down(job, error):
    code, slurm, run_dir = job(STARTED="node1 node3", UNREACHED="node2", SRUN_ERROR=error)
    assert slurm.downed == [] and slurm.lifted == [] and code == 1
    assert not (run_dir / "launch-failures").exists()


def test_a_node_whose_launcher_started_is_not_lost(job):
    code, slurm, _ = job(STARTED="node1 node2 node3", UNREACHED="node2")
    assert slurm.downed == [] and code == 1


def test_when_every_node_seems_lost_nothing_is_marked_down(job, capfd):
    code, slurm, _ = job(STARTED="", UNREACHED="node1 node2 node3")
    assert slurm.downed == [] and code == 1
    assert "not a lost node" in batch_log(capfd)


def test_without_operator_rights_the_job_waits_for_slurm_to_notice(job, capfd, monkeypatch):
    """Slurm marks the node DOWN itself after SlurmdTimeout, requeues the job and ends it: TERM."""
    monkeypatch.setattr("toolkit.job.controller.POLL_S", 0.05)
    slurm = FakeSlurm(["node1", "node2", "node3"], operator=False)
    code, _, _ = job(slurm=slurm, STARTED="node1 node3", UNREACHED="node2")
    assert code == 143 and slurm.lifted == [("7", 4)]
    assert "needs Slurm operator rights: waiting up to 90 s" in batch_log(capfd)


def earlier_losses(run_dir: Path, count: int, step: int = 40, checkpoint: int = 40) -> None:
    (run_dir / "checkpoints.json").write_text(json.dumps({"shared": {"step": checkpoint, "at": 1}}))
    (run_dir / "launch-failures").write_text("".join(f"{n} {step} node9\n" for n in range(count)))


def test_a_node_lost_again_is_requeued_after_a_backoff(job):
    code, slurm, _ = job(during=lambda c: earlier_losses(c.layout.root, 2), STARTED="node1 node3", UNREACHED="node2")
    assert slurm.lifted == [("7", 63)] and slurm.downed[0][0] == "node2"


def test_requeues_stop_after_the_runs_budget(job, capfd):
    code, slurm, _ = job(during=lambda c: earlier_losses(c.layout.root, 3), STARTED="node1 node3", UNREACHED="node2")
    assert slurm.downed == [] and slurm.lifted == [] and code == 1
    assert "not requeueing again" in batch_log(capfd)


def test_the_budget_is_the_recipes(job):
    code, slurm, _ = job(watchdog={"max_requeues": 5}, during=lambda c: earlier_losses(c.layout.root, 3),
                         STARTED="node1 node3", UNREACHED="node2")
    assert slurm.lifted == [("7", 93)] and code == 143


def test_losses_with_a_new_checkpoint_between_count_afresh(job):
    """A long run on a flaky cluster loses nodes now and then: the budget is for losses in a row
    without progress, not for the run's whole life."""
    def five_losses_each_after_a_checkpoint(controller):
        (controller.layout.root / "launch-failures").write_text("".join(f"{n} {10 * n} node9\n" for n in range(5)))
        (controller.layout.root / "checkpoints.json").write_text('{"shared": {"step": 60, "at": 1}}')

    _, slurm, run_dir = job(during=five_losses_each_after_a_checkpoint, STARTED="node1 node3", UNREACHED="node2")
    assert slurm.lifted == [("7", 4)]  # the first in a row: no backoff
    assert (run_dir / "launch-failures").read_text().splitlines()[-1] == "7 60 node2"


def time_limit_near(after_s: float):
    import threading

    def send(_controller) -> None:
        threading.Timer(after_s, os.kill, (os.getpid(), signal.SIGUSR2)).start()
    return send


def test_the_time_limit_near_checkpoints_then_requeues_at_once(job, capfd):
    slurm = FakeSlurm(["node1", "node2", "node3"], ends_job=False)
    code, _, _ = job(slurm=slurm, during=time_limit_near(1.0), UNTIL_SIGNAL="1")
    log = batch_log(capfd)
    assert "time limit near: checkpointing, then requeueing job 7" in log
    assert code == 0 and slurm.requeued == ["7"] and slurm.lifted == [("7", 4)]


def test_the_time_limit_signal_after_the_run_finished_requeues_nothing(job, capfd):
    """USR2 (the time limit near) as the run ends: the run is done, and a requeue would only start
    a job that has nothing to do."""
    slurm = FakeSlurm(["node1", "node2", "node3"], ends_job=False)
    code, _, _ = job(slurm=slurm, during=time_limit_near(1.5), FINISH="30")
    assert "has finished: not requeueing" in batch_log(capfd)
    assert code == 0 and slurm.requeued == [] and slurm.lifted == []


def test_a_finished_run_is_never_run_again(job, capfd):
    code, slurm, run_dir = job(during=lambda c: (c.layout.root / "done").touch())
    assert code == 0 and not (run_dir / "launches").exists()
    assert "finished already" in batch_log(capfd)


def test_a_run_record_that_cannot_be_written_unforeseen_costs_the_job_nothing(job, capfd, monkeypatch):
    """controller.py's blind except around the run's record: its write failing in a way nobody foresaw
    (neither an OSError nor a damaged spec) is said, and the job goes on to launch and end as it would
    (narrowed to OSError, this test fails: checked)."""
    from toolkit.runs import register

    class Unforeseen(Exception):
        pass

    def failing(*args, **kwargs):
        raise Unforeseen("the run store broke in a way nobody foresaw")

    monkeypatch.setattr(register, "register", failing)
    code, slurm, run_dir = job(LEAVE="4", STATUS="4")
    assert code == 4 and slurm.requeued == [] and len((run_dir / "launches").read_text().splitlines()) == 1
    log = batch_log(capfd)
    assert "could not record job 7 in the run's record: the run store broke in a way nobody foresaw" in log
    assert "not worth a requeue" in log  # the step ran and its end was judged as ever


def test_out_of_memory_is_retried_once_with_the_smaller_micro_batch(job, capfd):
    code, slurm, run_dir = job(LEAVE="5", STATUS="5")
    assert (run_dir / "launches").read_text().splitlines() == ["", "1"]  # FT_OOM_RETRY on the second
    assert code == 5 and slurm.requeued == []
    log = batch_log(capfd)
    assert log.count("retrying once with a smaller micro batch") == 1 and "out of memory again" in log


def test_a_user_error_is_not_worth_a_requeue(job, capfd):
    code, slurm, run_dir = job(LEAVE="4", STATUS="4")
    assert code == 4 and slurm.requeued == [] and len((run_dir / "launches").read_text().splitlines()) == 1
    assert "not worth a requeue" in batch_log(capfd)


@pytest.mark.parametrize("slurm_requeues, requeued", [(False, ["7"]), (True, [])])
def test_a_stop_on_request_is_requeued_unless_slurm_requeues_the_preempted_job(job, slurm_requeues, requeued):
    slurm = FakeSlurm(["node1", "node2", "node3"], ends_job=False, requeues_preempted=slurm_requeues)
    code, _, _ = job(slurm=slurm, LEAVE="8", STATUS="8")
    assert code == 0 and slurm.requeued == requeued


def lost_in_training(controller) -> None:
    """The watchdog hands back node3 lost, no spare left (toolkit/job/supervise.py, tested in test_watch.py)."""
    from toolkit.runs import exits

    class Watchdog:
        excluded = ["node3"]

        def __init__(self):
            controller.supervisor = self

        def run(self):
            (controller.layout.root / "exit-status").unlink(missing_ok=True)
            return exits.NODES_LOST

        def close(self):
            pass

        def on_signal(self, signum, frame):
            pass

    controller.supervised = lambda argv: Watchdog().run()


def test_nodes_lost_in_training_requeue_the_job_without_marking_them(job, capfd):
    """No spare left: the watchdog marked silent nodes DOWN (or left drained ones to their reason);
    the job requeues itself, as Slurm requeues nothing under --no-kill, and lifts the hold."""

    slurm = FakeSlurm(["node1", "node2", "node3"])
    code, _, _ = job(slurm=slurm, during=lost_in_training)
    assert code == 143 and slurm.requeued == ["7"] and slurm.downed == [] and slurm.lifted == [("7", 4)]
    assert "is requeued without node3 (lost nodes, requeue 1 of at most 3)" in batch_log(capfd)


def test_a_damaged_spec_stops_the_job_as_a_user_error(job, capfd):
    def damage(controller) -> None:
        controller.layout.spec.write_text('{"recipe": {}}')

    code, slurm, run_dir = job(during=damage)
    assert code == 4 and not (run_dir / "launches").exists()
    assert "does not hold a usable run spec" in batch_log(capfd)


def test_the_step_is_the_specs():
    plan = StepPlan(python="/opt/env/bin/python", srun_options=["--mpi=pmix", "--container-image=img"])
    argv = plan.srun(2, "/runs/r1/logs/node-%N.log", cpus_on_node="96", cpus_per_task="12")
    assert argv[:6] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                        "--cpus-per-task=12"]
    assert argv[6:] == ["--output=/runs/r1/logs/node-%N.log", "--mpi=pmix", "--container-image=img",
                        "/opt/env/bin/python", "-m", "toolkit.launch"]
    whole = StepPlan(whole_nodes=True).srun(1, "/l/node-%N.log", cpus_on_node="96", cpus_per_task="")
    assert "--cpus-per-task=96" in whole
    assert "--cpus-per-task=1" in StepPlan().srun(1, "/l/node-%N.log", cpus_on_node="96", cpus_per_task="")


def test_losses_in_a_row_follow_the_checkpoint_step(tmp_path):
    ledger = tmp_path / "launch-failures"
    assert losses.losses_in_a_row(ledger, "1", None, ["n1"]) == 1
    assert losses.losses_in_a_row(ledger, "2", None, ["n2"]) == 2
    assert losses.losses_in_a_row(ledger, "3", 10, ["n1", "n2"]) == 1
    assert ledger.read_text().splitlines()[-1] == "3 10 n1 n2"
    assert losses.checkpoint_step(tmp_path / "missing.json") is None
    (tmp_path / "c.json").write_text('{"shared": {"step": "40"}}')
    assert losses.checkpoint_step(tmp_path / "c.json") is None  # a step is an integer, or none
    assert [requeue_backoff(n) for n in (1, 2, 3)] == [1, 30, 60]


# -- found by an adversarial review (session 19) ---------------------------------------------------
SELF_KILLING_SRUN = """#!/bin/bash
case "$*" in *toolkit.launch.warm) exec /bin/sleep 30 ;; esac
for node in $STARTED; do touch "$FT_LAUNCH_MARKS/$node"; done
kill -KILL $$
"""


@pytest.mark.parametrize("watchdog", [False, True])
def test_a_step_killed_by_a_signal_ends_the_job_as_a_shell_would_say_it(job, tmp_path, watchdog):
    import subprocess

    def replace_srun(_controller) -> None:
        (tmp_path / "bin" / "srun").write_text(SELF_KILLING_SRUN)

    code, _, _ = job(watchdog={"enabled": watchdog}, during=replace_srun)
    assert subprocess.run([sys.executable, "-c", f"import sys; sys.exit({code})"]).returncode in (137, 247)
    if not watchdog:
        assert code == 137  # 128 + KILL, as the old bash script exited


def test_a_requeue_slurm_does_not_take_fails_the_job(job, monkeypatch, capfd):
    """The time limit near and `scontrol requeue` not answering (the controller busy): the job neither
    finished nor goes on, so it must not end as COMPLETED."""
    from toolkit.base.errors import FtError
    from toolkit.watch import requeue

    class Busy(FakeSlurm):
        def requeue(self, job_id: str) -> bool:
            self.asked = getattr(self, "asked", 0) + 1
            raise FtError("`scontrol requeue 7` did not answer within 20 s")

    slurm = Busy(["node1", "node2", "node3"], ends_job=False)
    code, _, _ = job(slurm=slurm, during=time_limit_near(1.0), UNTIL_SIGNAL="1")
    assert code == 1 and slurm.asked == 3 and slurm.lifted == []  # asked again, as Slurm may be slow
    assert "Slurm took no requeue of job 7" in batch_log(capfd)
    assert requeue.AFTER_S == 1


class CancelledWhileAsking(FakeSlurm):
    """The user's scancel (TERM) while the job asks Slurm something after its step ended."""

    def cancel_now(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)

    def config_seconds(self, name: str) -> int:
        if name == "SlurmdTimeout":
            self.cancel_now()
        return super().config_seconds(name)

    def requeues_preempted(self, job_id: str, partition: str) -> bool:
        self.cancel_now()
        return False


def test_a_cancel_as_the_job_requeues_itself_is_not_undone(job):

    slurm = CancelledWhileAsking(["node1", "node2", "node3"], ends_job=False)
    code, _, _ = job(slurm=slurm, during=lost_in_training)
    assert code == 143 and slurm.requeued == []
    stopped, _, _ = job(slurm=CancelledWhileAsking(["node1", "node2", "node3"], ends_job=False), LEAVE="8", STATUS="8")
    assert stopped == 143


def test_a_spec_from_an_older_script_takes_the_site_from_what_that_script_exported(tmp_path, monkeypatch):
    """A job requeued across an upgrade of ft reruns the script it was submitted with: its spec has no
    `site`, its values are the variables that script exported."""
    import subprocess

    from toolkit.recipe.run_spec import RunSpec

    spec = json.loads(run_spec_json())
    del spec["site"]
    monkeypatch.setenv("FT_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("FT_DIST_BACKEND", "gloo")
    monkeypatch.setenv("FT_S3_PREFIX", "s3://ckpt")
    old = RunSpec.model_validate_json(json.dumps(spec))
    assert (old.site.distributed_backend, old.site.s3_prefix, old.site.receipt_signer) == ("gloo", "s3://ckpt", "")
    # And the entry that script runs is still there (its usage, without a step to run).
    legacy = subprocess.run([sys.executable, "-m", "toolkit.watch.supervise"], capture_output=True, text=True,
                            cwd=REPO)
    assert legacy.returncode == 2 and "usage" in legacy.stderr


def run_spec_json() -> str:
    resolved = resolve(REPO / "recipes" / "tiny-lora-sft.yaml", "lab")
    script = render(resolved, RunPlacement("r1", "/shared/runs/r1"), login_python=sys.executable)
    return script.split("<<'FT_RECIPE_JSON'\n", 1)[1].split("\nFT_RECIPE_JSON\n", 1)[0]


def test_a_successors_requeue_keeps_its_begin_time_past_the_steps_whose_clients_died_with_the_batch_host(
        tmp_path, monkeypatch):
    """The adopted training step and the warm templates were started by the lost batch host's srun:
    each completes only after its slurmstepd gave up telling that client (toolkit/watch/requeue.py),
    so a successor's lift of Slurm's hold waits for them; the job script's own does not."""
    from toolkit.job.supervise import Adoption
    from toolkit.watch import requeue

    asked = []
    monkeypatch.setattr(requeue, "stay_as_last", lambda *args, **options: asked.append(options["clients_lost"]))
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    for adoption in (None, Adoption("n3", "7.2", ["n1", "n2"], 1)):
        controller = JobController(tmp_path, FakeSlurm(["n1", "n2", "n3"]), adoption=adoption)
        controller.expect_requeue()
        controller.lift_requeue_hold()
    assert asked == [False, True]
