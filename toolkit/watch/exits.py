"""How an ft job's processes end, and what each ending costs: the one table the workers, the
launchers, the supervisor and the job script follow.

    code  meaning                          what happens
    0     done                             the run is finished (a `done` mark: never rerun)
    4     user error (NaN loss, bad data)  stop: a restart would fail the same way
    5     out of memory                    the job script retries once with a smaller micro batch
    6     a rank hung                      restart from the latest checkpoint, same nodes
    7     lost nodes, no spare left        the job script requeues the job without them
    8     stopped on request, checkpointed the job script requeues the job (preempted, or the time
                                           limit near), which resumes from that checkpoint
    other a rank died, a collective broke  restart from the latest checkpoint, same nodes, with a
                                           backoff, at most watchdog.max_restarts times

The rank or launcher that ends a step first leaves its code in <run dir>/exit-status: srun itself
reports the highest code of its tasks, and the ones it stopped because another failed count as
terminated (15), which would hide the cause.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from toolkit.runs.layout import RunLayout

DONE = 0
USER_ERROR = 4
OUT_OF_MEMORY = 5
HUNG = 6
NODES_LOST = 7
STOPPED = 8
NOT_RESTARTED = {USER_ERROR, OUT_OF_MEMORY, STOPPED}


def leave_exit_status(run_dir: Path, status: int) -> None:
    """Say why this step ends, for the supervisor and the job script (written whole: renamed in)."""
    path = RunLayout(run_dir).exit_status
    staged = path.with_name(f".{path.name}.{os.getpid()}")
    staged.write_text(f"{status}\n")
    staged.replace(path)


def read_exit_status(run_dir: Path) -> int | None:
    try:
        text = RunLayout(run_dir).exit_status.read_text(errors="replace").strip()
    except OSError:
        return None
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 3 else None


def clear_exit_status(run_dir: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        RunLayout(run_dir).exit_status.unlink()
