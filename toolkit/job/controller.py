"""The job on its batch host, from the job script's last line (`python -m toolkit.job`) to its end.

It starts the training step (under ft's watchdog, toolkit/job/supervise.py, which restarts
training inside the allocation), passes Slurm's signals on to it, and decides what the step's
ending costs, by the codes of toolkit/runs/exits.py:

- the time limit near (USR2, `--signal=B:USR2@...`): the ranks checkpoint, and the job requeues
  itself to go on from that checkpoint;
- TERM (a preemption, a cancel, Slurm requeueing the job): the ranks checkpoint where they can, and
  the job ends (143); a requeued job goes on from its latest checkpoint by itself;
- nodes lost (before the step started on them, or in training with no spare left): the job is
  requeued without them, at most `watchdog.max_requeues` times in a row without a new checkpoint,
  and never when every node seems lost (then the fault is elsewhere: the network, the controller);
- out of memory: one retry from the latest checkpoint with a smaller micro batch and more
  accumulation (the same global batch: derived.out_of_memory_micro_batch);
- stopped on request after a checkpoint (8): requeued to go on, unless Slurm requeues the job itself;
- a user error (4), or anything else: the job ends with that status.

Every decision is a line of the batch log (`ft: ...`). Slurm is reached only through
toolkit/slurm's client.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from toolkit.base.errors import FtError
from toolkit.job import losses
from toolkit.job.supervise import Adoption, Supervisor
from toolkit.runs import exits
from toolkit.runs.layout import SRUN_ERRORS, STEP_COMMAND, RunLayout, RunSpecError
from toolkit.runs.timeline import record
from toolkit.slurm.client import CliSlurmClient, SlurmClient
from toolkit.watch import requeue

T = TypeVar("T")
TERMINATED = 143  # 128 + SIGTERM: the job ended by Slurm (a preemption, a cancel, a requeue)
POLL_S = 0.2


def say(message: str) -> None:
    print(f"ft: {message}", flush=True)


def requeue_backoff(losses_in_a_row: int) -> int:
    """Seconds from the requeued job's end to its new start: at once for a first loss, then 30 s
    more for each loss in a row (a cluster losing node after node is given time)."""
    return 30 * (losses_in_a_row - 1) if losses_in_a_row > 1 else 1


class JobController:
    """adoption: this controller succeeds a lost batch host's (toolkit/job/successor.py): it takes
    over the training step that one started, and the job's start is not begun again."""

    def __init__(self, run_dir: Path, slurm: SlurmClient | None = None, adoption: Adoption | None = None):
        self.adoption = adoption
        self.layout = RunLayout(run_dir)
        self.slurm = slurm or CliSlurmClient()
        self.job_id = os.environ["SLURM_JOB_ID"]
        self.restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        self.run_id = os.environ.get("FT_RUN_ID", run_dir.name)
        self.launches = 0
        self.signal: int | None = None  # the last of USR2 (time limit near) and TERM that came
        self.supervisor: Supervisor | None = None
        self.process: subprocess.Popen | None = None
        self.passed_on = False  # the signal reached the running step
        self.requeue_after: int | None = None  # a requeue is coming: its new start this long after the end here
        self.terminated_at: float | None = None  # when Slurm's TERM came (time.monotonic())
        self.step_command: list[str] | None = None  # a successor's: the training step the batch host started

    # -- the job -------------------------------------------------------------------------------
    def run(self) -> int:
        if self.layout.done.exists():  # written when the run finished: a requeue after that never reruns it
            say(f"run {self.run_id} finished already (job {self.job_id}, restart {self.restart}): nothing to do")
            return exits.DONE
        try:
            self.spec = self.layout.read_spec()
        except RunSpecError as exc:  # a damaged spec is not worth a requeue
            print(f"ft: {exc.message} ({exc.hint})", file=sys.stderr, flush=True)
            return exits.USER_ERROR
        self.allocation = self.slurm.hostnames(os.environ["SLURM_JOB_NODELIST"])
        if self.adoption is None:  # a successor goes on with the start its batch host began
            self.register()
            if "FT_MAX_LAUNCH_REQUEUES" in os.environ:
                say("FT_MAX_LAUNCH_REQUEUES is no longer read: the recipe's watchdog.max_requeues is "
                    f"({self.spec.recipe.watchdog.max_requeues})")
            self.prepare_environment()
        status = self.launch()
        if self.signal is not None:
            return self.after_signal()
        lost, when = self.lost_nodes(status)
        if lost:
            self.requeue_without(lost, when)  # Slurm ends this process as it requeues the job
            if self.signal is not None:
                return self.after_signal()
        if status == exits.OUT_OF_MEMORY and os.environ.get("FT_OOM_RETRY") != "1":
            say("out of memory: retrying once with a smaller micro batch (same global batch)")
            os.environ["FT_OOM_RETRY"] = "1"  # the ranks' batch plan (toolkit/train/faults.py)
            status = self.launch()
            if self.signal is not None:
                return self.after_signal()
        return self.verdict(status)

    def register(self) -> None:
        """The job in the run's record, for `ft ls` and `ft status` (the script may have been submitted
        with plain sbatch); without the record the run goes on all the same."""
        from toolkit.runs.register import register

        try:
            register(self.layout.root, self.run_id, self.job_id, os.environ.get("FT_MODE", "train"))
        except Exception as exc:  # noqa: BLE001 - the record is for ft status; the job goes on without it
            print(f"ft: could not record job {self.job_id} in the run's record: {exc}", file=sys.stderr, flush=True)

    def prepare_environment(self) -> None:
        """The rendezvous (the allocation's first node; the port follows from the job id) and the
        secret the nodes' launchers prove to each other there: new at every start of the job, in its
        processes' environment only, never in a file."""
        address, port = self.allocation[0], 20000 + int(self.job_id) % 20000
        # FT_BATCH_PYTHON: the interpreter a successor of this process runs with (toolkit/launch/handover.py).
        os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port), FT_JOB_SECRET=secrets.token_hex(32),
                          FT_BATCH_PYTHON=sys.executable)
        say(f"job {self.job_id} (restart {self.restart}) on {os.environ['SLURM_JOB_NODELIST']}; "
            f"rendezvous {address}:{port}")

    # -- the step ------------------------------------------------------------------------------
    def launch(self) -> int:
        """One training step, to its end: its status, the one the rank or launcher that ended it
        first left behind where srun's own hides it (srun reports the highest status of its tasks,
        and a task it stopped because another one failed counts as terminated)."""
        if self.signal is not None:
            return TERMINATED
        self.supervisor, self.process = None, None
        self.launches += 1
        if self.adoption is not None and self.launches == 1:  # the step runs: its marks and command are its own
            self.marks = Path(os.environ["FT_LAUNCH_MARKS"])
            self.step_command = json.loads((self.marks / STEP_COMMAND).read_text())
            argv = self.step_command
        else:
            self.layout.clear_exit_status()
            # Each launcher leaves a mark here as it starts, and srun's own messages are kept here too:
            # together they tell a node lost before the step started from a failure of the run.
            self.marks = self.layout.start_marks(self.job_id, self.restart, self.launches,
                                                 self.adoption.lost if self.adoption else None)
            self.marks.mkdir(parents=True, exist_ok=True)
            os.environ["FT_LAUNCH_MARKS"] = str(self.marks)
            # A successor's own step has one CPU: the training step is the batch host's, as it was.
            argv = self.step_command or self.spec.step.srun(self.spec.recipe.resources.nodes,
                                                            str(self.layout.node_log("%N")),
                                                            os.environ.get("SLURM_CPUS_ON_NODE", "1"),
                                                            os.environ.get("SLURM_CPUS_PER_TASK", ""))
        self.passed_on = False
        status = self.supervised(argv) if self.spec.recipe.watchdog.enabled else self.plain(argv)
        with contextlib.suppress(OSError):  # srun's messages, into the batch log
            sys.stderr.write((self.marks / SRUN_ERRORS).read_text(errors="replace"))
            sys.stderr.flush()
        left = self.layout.read_exit_status()
        return left if status != 0 and left is not None else status

    def supervised(self, argv: list[str]) -> int:
        try:
            self.supervisor = Supervisor(argv, self.layout.root, self.slurm, on_requeue=self.expect_requeue,
                                         adoption=self.adoption if self.launches == 1 else None)
        except RunSpecError as exc:
            print(f"ft-watch: {exc}", file=sys.stderr, flush=True)
            return exits.USER_ERROR
        try:
            self.pass_on()
            return self.supervisor.run()
        finally:
            self.supervisor.close()

    def plain(self, argv: list[str]) -> int:
        with open(self.marks / SRUN_ERRORS, "ab") as errors:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=errors)
        self.pass_on()
        code = self.process.wait()
        return 128 - code if code < 0 else code  # srun ended by a signal: as a shell says it (137: KILL)

    # -- Slurm's signals -----------------------------------------------------------------------
    def on_signal(self, signum: int, _frame=None) -> None:
        """USR2 (checkpoint.before_time_limit s before the time limit) or TERM: passed on to the step,
        whose ranks checkpoint; what follows is decided once the step has ended (after_signal)."""
        if signum == signal.SIGUSR2:
            os.write(1, f"ft: time limit near: checkpointing, then requeueing job {self.job_id}\n".encode())
        else:
            os.write(1, f"ft: Slurm is ending job {self.job_id} (a preemption, a requeue for a failed node, or a "
                        "cancel): the ranks checkpoint where they can; a requeued job goes on from the latest "
                        "checkpoint by itself\n".encode())
        if signum == signal.SIGTERM and self.terminated_at is None:
            self.terminated_at = time.monotonic()
        if self.signal != signal.SIGTERM:  # TERM is final: a USR2 after it changes nothing
            self.signal = signum
        self.passed_on = False
        self.pass_on()

    def pass_on(self) -> None:
        if self.signal is None or self.passed_on:
            return
        if self.supervisor is not None:
            self.supervisor.on_signal(self.signal, None)
            self.passed_on = True
        elif self.process is not None and self.process.poll() is None:
            self.process.send_signal(self.signal)
            self.passed_on = True

    def after_signal(self) -> int:
        if self.signal == signal.SIGTERM:
            self.lift_requeue_hold()
            return TERMINATED
        if self.layout.done.exists():  # the signal came as the run ended: nothing to go on with
            say(f"time limit near, but run {self.run_id} has finished: not requeueing")
            return exits.DONE
        return self.requeue_itself()

    # -- the requeue ---------------------------------------------------------------------------
    def expect_requeue(self, _job_id: str = "", after: int = requeue.AFTER_S) -> None:
        """A requeue is coming (asked for here, or by Slurm for a node this job marked DOWN): this
        process lifts its hold before it ends (lift_requeue_hold)."""
        self.requeue_after = after

    def requeue_itself(self, after: int = requeue.AFTER_S) -> int:
        """The job requeued to go on from its checkpoint: 0, or 1 where Slurm took no requeue (the
        job ends failed, not completed: it neither finished nor goes on)."""
        self.expect_requeue(after=after)
        self.terminated_at = time.monotonic()  # Slurm's TERM follows the requeue at once
        if not requeue.retried(lambda: self.slurm.requeue(self.job_id), f"requeueing job {self.job_id}"):
            self.requeue_after = None
            say(f"Slurm took no requeue of job {self.job_id}: the run goes on from its checkpoint once submitted "
                "again (ft submit, or sbatch this script)")
            return 1
        self.lift_requeue_hold()
        return exits.DONE

    def lift_requeue_hold(self) -> None:
        """Slurm holds a requeued job for its credential lifetime (cred_expire: 120 s by default)
        unless its begin time is still ahead as it finishes completing: this process, the batch
        script, stays as the job's last on its node and keeps it ahead (toolkit/watch/requeue.py)."""
        if self.requeue_after is None:
            return
        after, self.requeue_after = self.requeue_after, None
        # A successor's job holds steps whose srun clients died with the lost batch host (the adopted
        # training step, the warm templates): each completes only after its slurmstepd gave up on them.
        requeue.stay_as_last(self.slurm, self.job_id, after,
                             on_lifted=lambda: record(self.layout.root, "requeue_hold_lifted", after=after),
                             terminated_at=self.terminated_at, clients_lost=self.adoption is not None)

    # -- lost nodes ----------------------------------------------------------------------------
    def lost_nodes(self, status: int) -> tuple[list[str], str]:
        if status == exits.NODES_LOST and self.supervisor is not None and self.supervisor.excluded:
            return list(self.supervisor.excluded), "training"  # named by the watchdog
        if status != 0 and self.layout.read_exit_status() is None:
            errors = ""
            with contextlib.suppress(OSError):
                errors = (self.marks / SRUN_ERRORS).read_text(errors="replace")
            return losses.lost_at_launch(self.allocation, self.marks, errors), "launch"
        return [], ""

    def requeue_without(self, lost: list[str], when: str) -> None:
        """The job requeued without its lost nodes (the platform's fault, not the run's), then Slurm
        ends this process. Lost at step launch: marked DOWN (where this user may), and Slurm requeues
        the job itself (--requeue) and cleans up the failed step (a plain requeue here would leave
        Slurm 22.05 unable to create the next step); without operator rights, Slurm marks the node
        DOWN by itself after SlurmdTimeout, and the job waits for that. Lost in training: the
        watchdog marked the silent nodes DOWN and left drained ones as they are; Slurm requeues
        nothing for a drained node, nor under --no-kill: the job requeues itself."""
        most, nodes = self.spec.recipe.watchdog.max_requeues, " ".join(lost)
        if len(lost) >= len(self.allocation):
            say(f"the step could not start on any node ({nodes}): not a lost node; not requeueing")
            return
        failures = losses.losses_in_a_row(self.layout.launch_failures, self.job_id,
                                          losses.checkpoint_step(self.layout.checkpoint_status), lost)
        if failures > most:
            say(f"nodes were lost under this run {failures} times in a row without a new checkpoint (now {nodes}): "
                "not requeueing again. Check those nodes (sinfo -R), then resubmit.")
            return
        wait_s = (self.ask(lambda: self.slurm.config_seconds("SlurmdTimeout"), None) or 300) * 3 + 60
        if self.signal is not None:  # cancelled (or the time limit) meanwhile: not requeued against it
            return
        self.expect_requeue(after=requeue_backoff(failures))
        if when == "launch":
            for node in lost:
                # Said first: Slurm may requeue the job, and end this process, as soon as the node is down.
                say(f"node {node} was lost before the step started on it: marking it down")
                reason = f"ft: lost before job {self.job_id} (run {self.run_id}) started on it"
                if not self.ask(lambda node=node, reason=reason: self.slurm.mark_node_down(node, reason), False):
                    say(f"marking {node} down needs Slurm operator rights: waiting up to {wait_s} s for Slurm to "
                        "notice")
        say(f"job {self.job_id} is requeued without {nodes} (lost nodes, requeue {failures} of at most {most}); "
            "Slurm ends this script as it does so")
        if when != "launch":  # refused only when Slurm is requeueing the job already (a node marked DOWN)
            self.ask(lambda: self.slurm.requeue(self.job_id), False)
        if self.wait(wait_s):
            self.requeue_after = None
            say(f"Slurm did not requeue job {self.job_id} within {wait_s} s: giving up (check sinfo -R)")

    # -- the ending ----------------------------------------------------------------------------
    def verdict(self, status: int) -> int:
        if status == exits.USER_ERROR:
            say("stopped on an error in the recipe or the data (see the rank logs); not worth a requeue")
        elif status == exits.STOPPED:
            # Slurm 24.05 on requeues a job preempted with PreemptMode=REQUEUE that ends within its
            # grace time itself, and a requeue of ft's too would run it once more when its next start
            # ends; before 24.05 such a job just completes, and only ft's requeue brings it back. A
            # stop on request, a site that cancels preempted jobs, Slurm not answering: ft requeues it.
            partition = os.environ.get("SLURM_JOB_PARTITION", "")
            if self.ask(lambda: self.slurm.requeues_preempted(self.job_id, partition), False):
                say(f"preempted: the ranks stopped after a checkpoint, and Slurm requeues job {self.job_id} to go "
                    "on from it")
            else:
                if self.signal == signal.SIGTERM:  # cancelled meanwhile: not requeued against it
                    return TERMINATED
                say(f"the ranks stopped on request after a checkpoint: requeueing job {self.job_id} to go on from it")
                return self.requeue_itself()
            return exits.DONE
        elif status == exits.OUT_OF_MEMORY:
            say("out of memory again with a smaller micro batch: lower data.max_seq_len or training.micro_batch, "
                "turn on training.gradient_checkpointing, or use more GPUs")
        return status

    # -- helpers -------------------------------------------------------------------------------
    def wait(self, seconds: float) -> bool:
        """True once `seconds` passed, False as soon as a signal came (its handler has run)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.signal is not None:
                return False
            time.sleep(POLL_S)
        return self.signal is None

    @staticmethod
    def ask(call: Callable[[], T], otherwise: T) -> T:
        """A Slurm command whose failure (a timeout: the controller is busy in a failure) is not
        this job's end: what the job does without its answer."""
        try:
            return call()
        except FtError as exc:
            print(f"ft: asking Slurm: {exc.message}", file=sys.stderr, flush=True)
            return otherwise


def main() -> int:
    controller = JobController(Path(os.environ["FT_RUN_DIR"]))
    signal.signal(signal.SIGUSR2, controller.on_signal)
    signal.signal(signal.SIGTERM, controller.on_signal)
    return controller.run()
