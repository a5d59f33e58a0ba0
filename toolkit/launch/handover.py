"""A lost batch host's job goes on: a successor takes over from the survivors.

While the job holds a spare, its batch host trains on no rank (toolkit/job/supervise.py keeps it
as the last spare), and Slurm keeps a --no-kill job RUNNING without it: only the job script and its
supervisor die with it. The survivors hear the supervisor go quiet; the first to report it marks
the node DOWN and starts a successor controller (toolkit/job/successor.py) as a step of the job on
a spare node, or on its own where no spare is left, which adopts the training step as it runs.
The successor says where it listens in the start's marks folder (the run directory: the user's
own); every launcher then sends its heartbeats there. Training never stops for it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from toolkit.base.errors import FtError
from toolkit.runs.layout import SUCCESSION, SUCCESSOR
from toolkit.slurm import steps
from toolkit.slurm.client import SlurmClient, job_nodes

# From the successor's start (srun, imports, Slurm's answers) to its word: seconds on the lab;
# longer is a successor that will not come (the reporter then requeues the job, as before).
HANDOVER_WAIT_S = 30.0
POLL_S = 0.1


@dataclass(frozen=True)
class Handover:
    """Where the successor of a lost batch host listens: what the launchers retarget to."""
    lost: str  # the batch host it succeeds
    node: str  # the successor's node
    address: str
    port: int

    @staticmethod
    def path(marks: Path, lost: str) -> Path:
        return marks / SUCCESSOR.format(node=lost)

    def write(self, marks: Path) -> None:
        """Whole or not at all (a reader must never see half of it)."""
        final = self.path(marks, self.lost)
        partial = final.with_name(f".{final.name}.{os.getpid()}")
        partial.write_text(json.dumps({"lost": self.lost, "node": self.node, "address": self.address,
                                       "port": self.port}))
        os.replace(partial, final)

    @classmethod
    def read(cls, marks: Path, lost: str) -> Handover | None:
        try:
            found = json.loads(cls.path(marks, lost).read_text())
            handover = cls(found["lost"], found["node"], found["address"], found["port"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        fields_ok = handover.lost == lost and isinstance(handover.address, str) and type(handover.port) is int
        return handover if fields_ok and 0 < handover.port < 65536 else None


def claim(marks: Path, lost: str, who: str) -> bool:
    """One of two takes the succession of `lost`, once: the successor ("successor", before it adopts
    anything) or the reporter giving up on it ("abandoned", before it requeues the job instead).
    True for the first; the other then stands down. The file says which."""
    try:
        descriptor = os.open(marks / SUCCESSION.format(node=lost), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(descriptor, "w") as out:
        out.write(who)
    return True


def claimed_by(marks: Path, lost: str) -> str:
    try:
        return (marks / SUCCESSION.format(node=lost)).read_text()
    except OSError:
        return ""


def successor_node(slurm: SlurmClient, job_id: str, training: list[str], lost: str, here: str) -> str:
    """A spare of the job (in it, training on no rank: the next last spare) where one is left, else
    this node. The job's nodes as Slurm has them now (nodes lost earlier were taken out of it), and
    not one drained (a hung node ft left out, or an admin's)."""
    try:
        spares = [node for node in job_nodes(slurm, job_id) or [] if node not in training and node != lost]
        drained = slurm.drained(spares) if spares else {}
    except FtError:
        spares, drained = [], {}
    spares = [node for node in spares if node not in drained]
    return spares[0] if spares else here


def start_successor(job_id: str, node: str, lost: str, step_id: str, start: str, training: list[str],
                    log_to: Path) -> subprocess.Popen:
    """The successor's step, its srun's own messages into this launcher's log (`log_to`). It runs on
    the node itself, as the job script did, with the job script's interpreter (FT_BATCH_PYTHON: the
    job controller sets it; a launcher in a container has another)."""
    python = os.environ.get("FT_BATCH_PYTHON") or sys.executable
    program = [python, "-m", "toolkit.job", "--successor-of", lost, "--step", step_id, "--start", start,
               "--training", ",".join(training)]
    with open(log_to, "ab") as errors:
        return subprocess.Popen(steps.successor_step(job_id, node, program), stdin=subprocess.DEVNULL,
                                stdout=errors, stderr=errors)


def wait_for_handover(marks: Path, lost: str, alive: Callable[[], bool] = lambda: True,
                      wait_s: float = HANDOVER_WAIT_S) -> Handover | None:
    """The successor's word, once it is written; None when `alive()` says the successor will not
    come (its srun ended), or after wait_s."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        handover = Handover.read(marks, lost)
        if handover is not None:
            return handover
        if not alive():  # one last look: it may have written its word as it ended
            return Handover.read(marks, lost)
        time.sleep(POLL_S)
    return None
