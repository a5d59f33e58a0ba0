"""A requeue at once: the hold Slurm puts on a requeued job, lifted from inside the job.

Slurm holds a requeued job for its credential lifetime before it may start again (AuthInfo
cred_expire: 120 s by default, 10 s on the lab), on top of the wait for a new allocation. Measured
on the lab, that hold was half of ft's recovery from a lost node without a spare (13.5 s of 26 s).
It guards that the new start's job credential is newer than the old start's revocation (timestamps
of one second) and that the old start's processes are gone. Slurm sets it as the requeued job
finishes completing (every process of it gone), and only where the job's begin time has passed
then; a begin time still ahead is kept. A requeued job is pending while it completes, so its
owner may set that begin time (`scontrol update StartTime`).

So the process of the job that asked for the requeue (the job itself on its batch host,
toolkit/job/controller.py; a surviving node's launcher that reported the batch host lost,
toolkit/launch/node.py) stays: Slurm's TERM is handled, not fatal. It ends what it started, keeps the
job's begin time a margin more than `after` seconds ahead while anything else of the job runs on
its node (`scontrol listpids`), and leaves as the last one: the job completes, and starts again at
that time. Inside the job, because nothing can outlive it where Slurm tracks
processes by cgroup (proctrack/cgroup: a step's processes all end as its task does). Where the
job's processes outlive Slurm's KillWait, its KILL ends this one with them, the begin time still
ahead by the margin.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

from toolkit.base.errors import FtError
from toolkit.slurm.client import JobInfo, SlurmClient
from toolkit.slurm.commands import expand_hostlist

# The begin time kept ahead at each look: a second, the credential clock's resolution. The job's new
# credential then dates after its old one's revocation (made at the requeue, before any update).
AFTER_S = 1
# Between two looks, and after the last process here left, the job completes before its begin time
# must have come: its steps' ends (a step whose srun client this process ended retries telling it
# for ~2 s: its slurmstepd, which no listing shows), the epilog. Begin times are whole seconds: 3 s
# more, against Slurm's whole hold. (Measured on the lab under proctrack/cgroup: 0.1-2.8 s.)
LEAVING_MARGIN_S = 3
# As Slurm's KILL nears (KillWait after the requeue's TERM), more: a step on another node may end a
# few seconds after its KILL (its slurmstepd retrying a srun that is gone: 2.3 s on the lab).
KILL_MARGIN_S = 5
POLL_S = 0.5  # one `scontrol show job` each: light on the controller, which a failure keeps busy
# Slurm's default MessageTimeout, where its configuration does not say (clients_lost below).
ORPHANED_MESSAGE_TIMEOUT_S = 10
# How long the requeue may take to show: it was asked for (or Slurm's TERM came from it) already.
WAIT_S = 30.0


def log(message: str) -> None:
    """To the log of the process that stays (the job's batch log, a node's log), as long as it lasts."""
    with contextlib.suppress(OSError, ValueError):
        print(f"ft-requeue: {time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def process_children() -> dict[int, list[int]]:
    """Each process's children, read from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    return children


def descendants(pid: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """Every process started by `pid`, and by those (parents first)."""
    children = process_children() if children is None else children
    found, parents = [], [pid]
    while parents:
        for child in children.get(parents.pop(0), []):
            found.append(child)
            parents.append(child)
    return found


def end_descendants(wait_s: float = 2.0) -> None:
    """KILL to every process this one started (srun's clients of the job's steps, ranks), and its
    own children reaped: a requeued job completes only once all of them are gone, and a client of a
    step that spanned a lost node never ends by itself (seen on the lab under proctrack/cgroup)."""
    me, children = os.getpid(), process_children()
    for pid in descendants(me, children):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    # Its own children only: a waitpid(-1) would take another thread's child's status (a Popen's).
    unreaped, deadline = set(children.get(me, [])), time.monotonic() + wait_s
    while unreaped and time.monotonic() < deadline:
        for pid in list(unreaped):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    unreaped.discard(pid)
            except ChildProcessError:  # reaped by its owner meanwhile
                unreaped.discard(pid)
        time.sleep(0.02)


def lift_hold(slurm: SlurmClient, job_id: str, after: int | Callable[[], int], may_leave: Callable[[JobInfo], bool],
              restarts: int = 0, wait_s: float = WAIT_S, on_lifted: Callable[[], object] = lambda: None) -> bool:
    """Once the job is requeued, keep its begin time `after` seconds (or what `after()` says at
    each look) ahead until `may_leave` (given
    what Slurm says of the job) says its completion waits on nothing but this process. Requeued: pending, or
    completing with its restart count up (a requeued job is pending underneath while it completes,
    and Slurm names it COMPLETING). False when the job ended instead (not requeued), or was not
    requeued within wait_s. Slurm being slow is asked again, not fatal. restarts: the job's restart
    count before the requeue (SLURM_RESTART_COUNT where it started). on_lifted: called once, as the
    begin time is first set (Slurm's KILL may end this process before it leaves)."""
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
            ahead = after() if callable(after) else after
            try:
                updated = slurm.start_after(job_id, ahead)
            except FtError:
                updated = False
            if updated and not lifted:
                log(f"job {job_id} requeued: it may start again {ahead} s after its last process here ends "
                    "(not after Slurm's credential hold)")
                lifted = True
                with contextlib.suppress(OSError):  # a record of it (the run's events): never fatal
                    on_lifted()
            if lifted and may_leave(info):
                return True
        elif lifted:  # started again already
            return True
        time.sleep(POLL_S)
    if not lifted:
        log(f"job {job_id} was not requeued within {wait_s:.0f} s: left as it is")
    return lifted


def stay_as_last(slurm: SlurmClient, job_id: str, after: int = AFTER_S, restarts: int | None = None,
                 wait_s: float = WAIT_S, on_lifted: Callable[[], object] = lambda: None,
                 terminated_at: float | None = None, clients_lost: bool = False) -> bool:
    """This process, of a job being requeued, ends what it started, lifts the hold while anything
    else of the job runs on its node, and returns as the last one (or once the job turns out not
    to be requeued): the caller then ends. True where the hold was lifted. terminated_at: when
    Slurm's TERM came (time.monotonic(); None: now), from which its KILL follows after KillWait.
    restarts: the job's restart count before the requeue (None: this start's, SLURM_RESTART_COUNT).
    clients_lost: the srun clients of the job's steps ran on a node that is lost (the batch host):
    each step here completes only after its slurmstepd has given up telling its client that its
    tasks ended (twice MessageTimeout: 19-20 s on the lab, whose MessageTimeout is 10 s), long after
    this process leaves or Slurm's KILL ends it; the begin time it leaves covers that (still sooner
    than Slurm's own hold, which would count from that completion)."""
    if restarts is None:
        count = os.environ.get("SLURM_RESTART_COUNT", "0")
        restarts = int(count) if count.isdigit() else 0
    end_descendants()
    me, node = os.getpid(), os.environ.get("SLURMD_NODENAME", "")

    def last_one(info: JobInfo) -> bool:
        """Nothing else of the job here (`scontrol listpids`), and no other node still completing it
        (a completing job's nodes, as Slurm names them: a step on another node may outlive this one's)."""
        if set(expand_hostlist(info.nodes)) - {node}:
            return False
        try:
            pids = slurm.job_pids_here(job_id)
        except FtError:
            pids = None
        if pids is None or me not in pids:
            return True
        # Still running: not this process, nor the scontrol it ran to ask (listed too, gone since).
        return not [pid for pid in pids if pid != me and os.path.exists(f"/proc/{pid}")]

    kill_wait = config_seconds(slurm, "KillWait")
    # 30 s: Slurm's default.
    kill_at = (terminated_at or time.monotonic()) + (30 if kill_wait is None else kill_wait)
    orphaned_s = 0
    if clients_lost:
        message_timeout = config_seconds(slurm, "MessageTimeout")
        orphaned_s = 2 * (ORPHANED_MESSAGE_TIMEOUT_S if message_timeout is None else message_timeout)

    def ahead() -> int:
        near_kill = time.monotonic() > kill_at - 2 * POLL_S - 1
        return max(AFTER_S, after) + (KILL_MARGIN_S if near_kill else LEAVING_MARGIN_S) + orphaned_s

    lifted = lift_hold(slurm, job_id, ahead, last_one, restarts, wait_s, on_lifted)
    if lifted:  # the begin time from the moment it leaves
        with contextlib.suppress(FtError):
            slurm.start_after(job_id, ahead())
        log(f"job {job_id}: nothing else of it runs here or completes elsewhere: leaving, its begin time "
            f"{ahead()} s ahead")
    return lifted


def config_seconds(slurm: SlurmClient, name: str) -> int | None:
    """A duration of Slurm's configuration; None where Slurm does not say (or cannot be asked)."""
    try:
        return slurm.config_seconds(name)
    except FtError:
        return None


def retried(call: Callable[[], bool], what: str, tries: int = 3) -> bool:
    """A Slurm command that timed out is sent again: a failure keeps the controller busy."""
    for attempt in range(1, tries + 1):
        try:
            return call()
        except FtError as exc:
            log(f"{what}: {exc.message}" + ("; trying again" if attempt < tries else "; giving up"))
    return False
