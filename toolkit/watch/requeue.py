"""A requeue at once: the hold Slurm puts on a requeued job, lifted.

Slurm holds a requeued job for its credential lifetime before it may start again (AuthInfo
cred_expire: 120 s by default, 10 s on the lab), on top of the wait for a new allocation. Measured
on the lab, that hold was half of ft's recovery from a lost node without a spare (13.5 s of 26 s).
It guards that the new start's job credential is newer than the old start's revocation (timestamps
of one second) and that the old start's processes are gone. Slurm sets it as the requeued job
finishes completing (every process of it gone), and only where the job's begin time has passed
then; a begin time still ahead is kept. A requeued job is pending while it completes, so its
owner may set that begin time (`scontrol update StartTime`).

So whoever stays longest keeps the job's begin time a little ahead (`lift_hold`: --after, 1 s)
once it is pending again, until the job's completion no longer waits on anything but itself, and
leaves: the job completes, its begin time still ahead, and starts again at that time.

- The job's own requeues (the time limit, nodes lost with no spare left): the batch script itself
  stays, as the job's last process on its node (toolkit/job/controller.py). Inside the job: Slurm
  ends every process of the batch step as the script ends where it tracks processes by cgroup
  (proctrack/cgroup), so no helper could outlive it there.
- A surviving node that requeues the job for its lost batch host (toolkit/launch/node.py): this
  module as a helper process, which ignores the TERM Slurm sends every process of the job and
  watches the job complete. It outlives its launcher where Slurm tracks processes by their parents
  (proctrack/linuxproc) only.

Where something of the job outlives the begin time, or Slurm's KILL ends the one that stays first,
the job waits out the hold as before: nothing is lost but the seconds.

    python -m toolkit.watch.requeue JOB [--requeue] [--down NODE --reason TEXT] [--after S] [--starter PID]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from toolkit.errors import FtError
from toolkit.runs.timeline import record
from toolkit.slurm.client import CliSlurmClient, SlurmClient

WAIT_S = 180.0  # for the requeue: a drained node's ranks checkpoint first (supervise.CHECKPOINT_GRACE_S)
POLL_S = 0.5  # one `scontrol show job` each: light on the controller, which a failure keeps busy
# The begin time kept ahead of each update: a second, the credential clock's resolution. The job's
# new credential then dates after its old one's revocation (made at the requeue, before any update);
# its old processes Slurm waits for itself (a requeued job starts again only once it completed).
AFTER_S = 1


def log(message: str) -> None:
    """To the log of whoever started this (the job's batch log, a node's log), as long as it lasts:
    it may be closed under the helper as the job ends. The outcome goes to the run's events too."""
    with contextlib.suppress(OSError, ValueError):
        print(f"ft-requeue: {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def lift_hold_soon(job_id: str, after: int = AFTER_S, requeue: bool = False,
                   down: tuple[str, str] | None = None) -> subprocess.Popen | None:
    """Start the helper, detached from the caller's signals: its own session (srun's interrupts go
    to the caller's process group) and TERM ignored from the first instruction (a disposition that
    exec keeps, unlike a handler; set by sh, as Python could only set it after starting).
    requeue: the helper requeues the job itself; down: (node, reason) it marks DOWN after that."""
    argv = [sys.executable, "-m", "toolkit.watch.requeue", job_id, "--after", str(after), "--starter", str(os.getpid())]
    if requeue:
        argv.append("--requeue")
    if down:
        argv += ["--down", down[0], "--reason", down[1]]
    try:
        return subprocess.Popen(["/bin/sh", "-c", 'trap "" TERM INT HUP; exec "$@"', "sh", *argv],
                                stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        log(f"could not start the helper that lifts Slurm's requeue hold ({exc}): the job waits it out")
        return None


def lift_hold(slurm: SlurmClient, job_id: str, after: int, starter_alive: Callable[[], bool],
              wait_s: float = WAIT_S, on_lifted: Callable[[], object] = lambda: None, restarts: int = 0,
              may_leave: Callable[[str], bool] = lambda state: True) -> bool:
    """Once the job is requeued, keep its begin time `after` seconds ahead until its starter is gone
    and `may_leave` (given the job's state) says the job's completion no longer waits on this
    helper, or has happened with the begin time ahead. Requeued: pending,
    or completing with its restart count up (a requeued job is pending underneath while it completes,
    and Slurm names it COMPLETING: where this helper is tracked as one of the job's processes,
    proctrack/cgroup, it never sees more than that). False when the job ended instead (not
    requeued), or was not requeued within wait_s. Slurm being slow is tried again, not fatal.
    restarts: the job's restart count before the requeue (SLURM_RESTART_COUNT where it started)."""
    deadline, lifted = time.monotonic() + wait_s, False
    while time.monotonic() < deadline:
        try:
            info = slurm.job_brief(job_id)
        except FtError as exc:
            log(f"asking Slurm about job {job_id}: {exc.message}; asking again")
            time.sleep(POLL_S)
            continue
        if info is None or (info.finished and info.restarts <= restarts):
            if not lifted:
                log(f"job {job_id} ended without a requeue: nothing to lift")
            return lifted
        requeued = info.state == "PENDING" or (info.state in ("COMPLETING", "REQUEUED") and info.restarts > restarts)
        if requeued:
            try:
                updated = slurm.start_after(job_id, after)
            except FtError:
                updated = False
            if updated and not lifted:
                log(f"job {job_id} requeued: it may start again {after} s after its last process here ends "
                    "(not after Slurm's credential hold)")
                on_lifted()
                lifted = True
            if lifted and not starter_alive() and may_leave(info.state):
                return True
        elif lifted:  # started again already (this helper was not one of the job's processes)
            return True
        time.sleep(POLL_S)
    log(f"job {job_id} was not requeued within {wait_s:.0f} s: left as it is")
    return lifted


def retried(call: Callable[[], bool], what: str, tries: int = 3) -> bool:
    """A Slurm command that timed out is sent again: the helper is the only one left to send it."""
    for attempt in range(1, tries + 1):
        try:
            return call()
        except FtError as exc:
            log(f"{what}: {exc.message}" + ("; trying again" if attempt < tries else "; giving up"))
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit.watch.requeue", description=__doc__.splitlines()[0])
    parser.add_argument("job_id")
    parser.add_argument("--after", type=int, default=AFTER_S,
                        help="seconds from the job's end here to its earliest new start")
    parser.add_argument("--starter", type=int, help="the process that started this one (default: its parent; "
                                                    "named, as it may be gone before this one looks)")
    parser.add_argument("--requeue", action="store_true", help="requeue the job first (refused harmlessly when "
                                                               "Slurm is requeueing it already)")
    parser.add_argument("--down", metavar="NODE", help="mark this node DOWN once the job is requeued (a lost node "
                                                        "the job still holds)")
    parser.add_argument("--reason", default="ft: lost", help="the reason given with --down")
    args = parser.parse_args(argv)
    slurm, starter = CliSlurmClient(), args.starter or os.getppid()
    if args.requeue:
        retried(lambda: slurm.requeue(args.job_id), f"requeueing job {args.job_id}")
    if args.down:  # after the requeue: marking it DOWN first would end the step this came from, at once
        marked = retried(lambda: slurm.mark_node_down(args.down, args.reason), f"marking {args.down} DOWN")
        log(f"node {args.down} {'marked DOWN' if marked else 'not marked DOWN (operator rights?)'}: {args.reason}")
    after = max(AFTER_S, args.after)
    run_dir = os.environ.get("FT_RUN_DIR")

    def on_lifted() -> None:
        if run_dir:
            with contextlib.suppress(OSError):
                record(Path(run_dir), "requeue_hold_lifted", after=after)

    count = os.environ.get("SLURM_RESTART_COUNT", "0")  # this start's: the job's, inherited
    def may_leave(state: str) -> bool:
        """Where Slurm tracks this helper as one of the job's processes (proctrack/cgroup), the job
        completes only once it ends: it leaves as the last of them on its node. Where it does not
        (proctrack/linuxproc: a process of its own session, its parent gone), it stays until the
        job has completed, its begin time still ahead: seen on the lab, ranks and templates took
        2.3 s to end after a requeue, past the begin time set as the starter ended, and Slurm held
        the job for cred_expire."""
        try:
            pids = slurm.job_pids_here(args.job_id)
        except FtError:
            pids = None
        if pids is not None and os.getpid() in pids:
            return not set(pids) - {os.getpid()}
        return state == "PENDING"

    lifted = lift_hold(slurm, args.job_id, after, lambda: os.getppid() == starter, on_lifted=on_lifted,
                       restarts=int(count) if count.isdigit() else 0, may_leave=may_leave)
    return 0 if lifted else 1


if __name__ == "__main__":
    sys.exit(main())
