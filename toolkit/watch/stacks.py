"""A hung rank's Python stacks, written into the run's logs before it is stopped: py-spy reads
them from outside the process (it works on a process that is stopped or stuck in C code, where
Python itself can run nothing); without py-spy, faulthandler in the worker prints them into the
rank's log on SIGUSR1 (only a process that still runs can)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from toolkit.runs.layout import RunLayout

DUMP_TIMEOUT_S = 20
# py-spy, reading a process that runs (a rank spinning in a collective), now and then catches a
# thread between frames and prints its header alone (seen on the lab, for the main thread while
# other threads' frames were there): it is asked again until the main thread's frames are in.
DUMP_TRIES = 5
FRAME_LINE = re.compile(r"^\s+\S.* \(.+:\d+\)\s*$", re.M)  # "    agree (toolkit/train/step_signals.py:77)"
THREAD_LINE = re.compile(r"^Thread (0x)?[0-9a-fA-F]+ .*$", re.M)  # 'Thread 21300 (active): "MainThread"'


def main_thread_frames(dump_text: str) -> bool:
    """The main thread's section of a py-spy dump has frames (the one that shows where training is)."""
    headers = list(THREAD_LINE.finditer(dump_text))
    for index, header in enumerate(headers):
        if '"MainThread"' in header.group(0):
            end = headers[index + 1].start() if index + 1 < len(headers) else len(dump_text)
            return FRAME_LINE.search(dump_text, header.end(), end) is not None
    return FRAME_LINE.search(dump_text) is not None  # no thread names (an older py-spy): any frame
FAULTHANDLER_SIGNAL = signal.SIGUSR1  # registered by the worker (toolkit/train/worker.py)
# A hung rank in one of these states hangs by itself, not waiting on a peer: its node is to blame
# (toolkit/job/supervise.py leaves a node out that keeps hanging). A rank waiting in a collective
# sleeps (S) or spins (R); which of those waits on whom, no state tells.
BLAMED_STATES = {"T": "stopped (SIGSTOP, or a debugger)", "t": "stopped by a debugger",
                 "D": "stuck in the kernel (a driver call, or I/O that does not return)"}


def process_state(pid: int) -> str:
    """The kernel's word for a process's state: R running, S sleeping, D in I/O, T stopped..."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat.rsplit(")", 1)[1].split()[0]


def dump(pid: int, target: Path) -> str:
    """Dump one process's stacks to `target`; says how."""
    state = process_state(pid)
    if state in ("T", "t"):  # py-spy cannot read a stopped process, and a signal would wait for SIGCONT
        target.write_text(f"# process {pid}, state {state}: stopped (SIGSTOP, or a debugger), so its stacks "
                          "cannot be read\n")
        return f"stopped (state {state}): a SIGSTOP or a debugger holds it"
    py_spy = str(Path(sys.executable).parent / "py-spy")
    py_spy = py_spy if Path(py_spy).is_file() else shutil.which("py-spy") or ""
    if py_spy:
        try:
            for _ in range(DUMP_TRIES):
                result = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True,
                                        timeout=DUMP_TIMEOUT_S)
                if result.returncode != 0 or main_thread_frames(result.stdout):
                    break
                time.sleep(0.2)  # caught the main thread between two Python frames: again
            target.write_text(f"# process {pid}, state {state}\n{result.stdout}{result.stderr}")
            if result.returncode == 0:
                return f"stacks in {target} (process state {state})"
        except subprocess.TimeoutExpired:
            target.write_text(f"# process {pid}, state {state}: py-spy took over {DUMP_TIMEOUT_S} s\n")
    try:
        os.kill(pid, FAULTHANDLER_SIGNAL)
        time.sleep(1)
    except ProcessLookupError:
        return "the process is gone"
    return f"stacks requested with faulthandler (in the rank's log); process state {state}"


BLAME_LOOKS = 5  # a D state is common and brief (a read, a write): only one that lasts is blamed
BLAME_EVERY_S = 0.2


def blame(pid: int) -> str | None:
    """Why a hung rank hangs by itself: stopped at any of BLAME_LOOKS looks, or in the kernel at
    every one; None where it may be waiting on a peer."""
    for look in range(BLAME_LOOKS):
        state = process_state(pid)
        if state in ("T", "t"):
            return BLAMED_STATES[state]
        if state != "D":
            return None
        if look < BLAME_LOOKS - 1:
            time.sleep(BLAME_EVERY_S)
    return BLAMED_STATES["D"]


def dump_all(layout: RunLayout, pids: dict[int, int], log: Callable[[str], None]) -> None:
    layout.stacks.mkdir(parents=True, exist_ok=True)
    stamp = f"{os.environ.get('SLURM_JOB_ID', 'job')}.{os.environ.get('FT_WATCH_START', '0')}"
    for rank, pid in sorted(pids.items()):
        log(f"rank {rank}: {dump(pid, layout.stack_dump(rank, stamp))}")
