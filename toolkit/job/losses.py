"""Nodes lost under a run: which ones a failed step launch lost, and how many losses in a row the
run has taken without a new checkpoint (a run that goes on between losses is never given up on;
one that cannot is)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

# srun's words for a node it could not reach to start the step: a communication failure, not a
# refusal (a bad credential, a failed prolog), which no other node would cure.
UNREACHABLE = ("Communication connection failure", "Socket timed out", "Connection refused", "No route to host")


def lost_at_launch(allocation: list[str], marks: Path, srun_errors: str) -> list[str]:
    """The nodes srun could not reach to start the step, and whose launcher left no mark
    (toolkit/launch/node.py leaves one as it starts)."""
    lines = srun_errors.splitlines()
    return [node for node in allocation if not (marks / node).exists()
            and any(f"failed on node {node}:" in line and any(words in line for words in UNREACHABLE)
                    for line in lines)]


def checkpoint_step(status_file: Path) -> int | None:
    """The run's newest shared checkpoint's step (toolkit/checkpoint/status.py writes it); None
    where there is none yet or the file cannot be read."""
    with contextlib.suppress(OSError, ValueError, RecursionError, TypeError, AttributeError):
        step = json.loads(status_file.read_text())["shared"]["step"]
        if type(step) is int:
            return step
    return None


def losses_in_a_row(ledger: Path, job_id: str, step: int | None, nodes: list[str]) -> int:
    """Record a loss (a line `<job> <checkpoint step|none> <nodes...>` appended to the run's
    ledger) and count the losses in a row with the same checkpoint step, this one included."""
    progress = "none" if step is None else str(step)
    with open(ledger, "a") as out:
        out.write(f"{job_id} {progress} {' '.join(nodes)}\n")
        out.flush()
        os.fsync(out.fileno())
    count = 0
    for line in ledger.read_text(errors="replace").splitlines():
        fields = line.split()
        count = count + 1 if len(fields) > 1 and fields[1] == progress else 0
    return count
