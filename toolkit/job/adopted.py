"""Steps a successor controller takes over (toolkit/job/successor.py): started by the lost batch
host's srun clients, which died with it, and running on without them. The supervisor handles them
as it handles the steps it starts itself (a subprocess.Popen's poll/send_signal/kill/wait), with
Slurm in the client's place: signals through `scancel --signal`, the end seen in Slurm's list of
the job's steps, or sooner in the launchers' goodbyes."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import threading
import time
from collections.abc import Callable

from toolkit.base.errors import FtError
from toolkit.slurm.client import SlurmClient

LISTING_TTL_S = 1.0  # Slurm is asked this often at most, whatever the number of steps watched
# After a KILL, the step is over this soon whatever Slurm lists: its tasks on live nodes die at once,
# and a step that spans a lost node stays listed until Slurm cleans it up (10 s on the lab), as a
# killed srun client would not wait for either (the next step overlaps what lingers).
KILLED_AFTER_S = 1.0


class StepListing:
    """The job's running steps, asked of Slurm at most every LISTING_TTL_S (shared by every adopted
    step: the supervisor polls each one every watch beat)."""

    def __init__(self, slurm: SlurmClient, job_id: str):
        self.slurm, self.job_id = slurm, job_id
        self.asked, self.steps = float("-inf"), None

    def steps_of_job(self) -> dict[str, list[str]] | None:
        """The job's running steps and their nodes (None: Slurm did not answer yet)."""
        self.refresh()
        return self.steps

    def running(self, step_id: str) -> bool | None:
        """Whether Slurm lists the step; None where it did not answer yet."""
        self.refresh()
        return None if self.steps is None else step_id in self.steps

    def refresh(self) -> None:
        if time.monotonic() - self.asked >= LISTING_TTL_S:
            try:
                steps = self.slurm.job_steps(self.job_id)
            except FtError:
                steps = None
            self.asked = time.monotonic()
            if steps is not None:
                self.steps = steps


class AdoptedStep:
    """A step of the job this process did not start. `goodbyes()`: the exit codes its tasks said as
    they ended (the launchers' last heartbeats); once every node's is in, the step is over."""

    def __init__(self, slurm: SlurmClient, listing: StepListing, step_id: str, nodes: list[str],
                 goodbyes: Callable[[], dict[str, int]] = dict):
        self.slurm, self.listing, self.step_id, self.nodes, self.goodbyes = slurm, listing, step_id, nodes, goodbyes
        self.returncode: int | None = None
        self.interrupts = 0
        self.killed_at: float | None = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        said = self.goodbyes()
        failed = [code for node, code in sorted(said.items()) if node in self.nodes and code]
        if self.nodes and all(node in said for node in self.nodes):
            self.returncode = failed[0] if failed else 0
        elif self.killed_at is not None and time.monotonic() - self.killed_at >= KILLED_AFTER_S:
            self.returncode = -signal.SIGKILL
        elif self.listing.running(self.step_id) is False:
            # Gone without every goodbye: a task killed (by Slurm, a cancel) before it could say one.
            self.returncode = failed[0] if failed else 1
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """As srun does: a signal passed on to every task; two interrupts end the step."""
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts < 2:
                return
            name = "KILL"
        else:
            name = signal.Signals(signum).name.removeprefix("SIG")
        if name == "KILL" and self.killed_at is None:
            self.killed_at = time.monotonic()
        # Sent from a thread of its own, as a signal to a process never blocks its sender: scancel
        # waits on the controller, which a node's failure keeps busy (11 s on the lab).
        threading.Thread(target=self.signal_now, args=(name,), daemon=True, name=f"ft-scancel-{name}").start()

    def signal_now(self, name: str) -> None:
        with contextlib.suppress(FtError):  # Slurm busy or away: the caller's wait runs out, and it kills the step
            self.slurm.signal_step(self.step_id, name)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.step_id, timeout)
            time.sleep(0.1)
        return code
