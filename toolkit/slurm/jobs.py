"""Jobs in Slurm's queue, and putting them there: squeue, sbatch, scancel.

Everything else in ft asks through these functions and gets typed answers (`QueuedJob`), whatever
the Slurm version (toolkit/slurm/shapes.py reads each version's JSON). Every function takes the
command runner (`run`), so unit tests give recorded answers of each Slurm version instead.

Where a job's free text matters (its comment says which run it is: ft-run=<run>), the queue is read
as JSON: a comment can hold a newline, which would forge a line of squeue's text output.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from toolkit.slurm import commands, shapes
from toolkit.slurm.commands import SlurmCommandError


@dataclass(frozen=True)
class QueuedJob:
    """One job as squeue --json gives it, the same on every Slurm version."""
    job_id: str  # each array element's own id (SLURM_JOB_ID)
    state: str  # RUNNING, PENDING, ...: the base state
    user: str = ""
    account: str = ""
    partition: str = ""
    reason: str = ""
    batch_host: str = ""
    comment: str = ""
    nodes: str = ""  # a host list: node[1-2]
    gpus: int = 0  # asked for (tres_req_str)
    end_time: float | None = None  # a running job's planned end (its time limit)
    time_limit_min: int | None = None  # None: unlimited
    eligible_time: float | None = None
    restarts: int = 0
    flags: tuple[str, ...] = ()  # beside the state (23.02 on): REQUEUED, ...


def parse_queue(text: str) -> list[QueuedJob]:
    """`squeue --json`'s jobs, as QueuedJob. ValueError where the answer is not squeue's JSON."""
    try:
        answer = json.loads(text)
    except (ValueError, RecursionError) as error:
        raise ValueError(f"squeue printed no JSON: {error}") from None
    listed = answer.get("jobs") if isinstance(answer, dict) else None
    if not isinstance(listed, list):
        raise ValueError("squeue's JSON has no job list")
    return [queued_job(job) for job in listed if isinstance(job, dict)]


def queued_job(job: dict) -> QueuedJob:
    def time_of(key: str) -> float | None:
        value = shapes.dig(job, key)
        return float(value) if isinstance(value, int | float) and value > 0 else None

    limit = shapes.dig(job, "time_limit")
    restarts = shapes.dig(job, "restart_cnt")
    return QueuedJob(
        job_id=str(shapes.dig(job, "job_id") or ""),
        state=shapes.state(job.get("job_state")),
        user=shapes.text(job.get("user_name")) or shapes.text(job.get("user")),
        account=shapes.text(job.get("account")),
        partition=shapes.text(job.get("partition")),
        reason=shapes.text(job.get("state_reason")),
        batch_host=shapes.text(job.get("batch_host")),
        comment=shapes.text(job.get("comment")),
        nodes=shapes.text(job.get("nodes")),
        gpus=shapes.tres_gpus(job.get("tres_req_str")),
        end_time=time_of("end_time"),
        time_limit_min=int(limit) if isinstance(limit, int | float) else None,
        eligible_time=time_of("eligible_time"),
        restarts=int(restarts) if isinstance(restarts, int | float) else 0,
        flags=shapes.state_flags(job.get("job_state")),
    )


def queue(run: Callable = commands.run, account: str | None = None, timeout: float = 10.0) -> list[QueuedJob]:
    """Every user's jobs in the queue (one account's only, where named). Raises FtError where Slurm
    does not answer, ValueError where its answer is not JSON. 22.05's squeue --json lists the whole
    queue whatever filter it is given: the account is filtered here too."""
    argv = ["squeue", "--all", "--json", *([f"--account={account}"] if account else [])]
    jobs = parse_queue(run(argv, timeout=timeout).stdout)
    return [job for job in jobs if account is None or job.account == account]


@dataclass(frozen=True)
class QueueLine:
    """A job as the cluster's metrics count it: where it waits, since when, and why."""
    job_id: str
    partition: str
    state: str
    eligible: float | None
    reason: str = ""


# JobID in --Format is each array element's own id (SLURM_JOB_ID), not "<array>_<index>" as %i.
# Text, not JSON: none of these is a user's free text, and squeue --json (which ignores squeue's
# default state filter from 23.02 on) is far heavier on a busy cluster, every scrape.
QUEUE_LINE_FORMAT = "--Format=Partition:|,State:|,EligibleTime:|,Reason:|,JobID:|"


def queue_lines(run: Callable = commands.run, timeout: float = 10.0) -> list[QueueLine]:
    """Every job in the queue, once per partition it was submitted to."""
    text = run(["squeue", "--all", "--noheader", QUEUE_LINE_FORMAT], timeout=timeout).stdout
    return parse_queue_lines(text)


def parse_queue_lines(text: str) -> list[QueueLine]:
    lines = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 4:
            job_id = parts[4].strip() if len(parts) > 4 else ""
            lines += [QueueLine(job_id, partition, parts[1].upper(), commands.slurm_time(parts[2]), parts[3])
                      for partition in parts[0].split(",") if partition]
    return lines


def own_jobs(run: Callable = commands.run, timeout: float = 20.0) -> list[tuple[str, str]] | None:
    """This user's queued and running jobs as (job id, comment); None where Slurm does not answer.
    %A: each array element's own id (%i would be 123_4). Text: the comment is this user's own (it
    forges nothing but their own lines)."""
    result = run(["squeue", "--noheader", "--user", str(os.getuid()), "--format=%A|%k"],
                 timeout=timeout, check=False)
    if result.returncode != 0:
        return None
    found = []
    for job_id, _, comment in (line.strip().partition("|") for line in result.stdout.splitlines()):
        if job_id.isdigit():
            found.append((job_id, comment))
    return found


def batch_host(job_id: str, run: Callable = commands.run) -> str | None:
    """The node a running job's script runs on; None where the job is not running (or unknown)."""
    if not job_id.isdigit():
        return None
    result = run(["squeue", "--noheader", "--jobs", job_id, "--format", "%B"], check=False)
    host = result.stdout.strip() if result.returncode == 0 else ""
    return None if not host or host.startswith("(") or host == "n/a" else host


def batch_script(job_id: str, run: Callable = commands.run, timeout: float = 10.0) -> str:
    """A job's batch script as Slurm holds it (`scontrol write batch_script JOB -`): what the job
    runs, whatever files were changed since. Only the job's owner, a Slurm operator or an admin may
    read it (the receipt signer's and the cluster exporter's accounts are operators). The text as
    Slurm prints it (a script with CR LF line ends reads as LF: ft's scripts have none).
    SlurmCommandError where Slurm refuses."""
    if not job_id.isdigit():
        raise SlurmCommandError(f"{job_id!r} is not a job id")
    return run(["scontrol", "write", "batch_script", job_id, "-"], timeout=timeout).stdout


def submit(script: Path, run: Callable = commands.run) -> str:
    """sbatch a script; its job id."""
    submitted = run(["sbatch", "--parsable", str(script)])
    job_id = submitted.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise SlurmCommandError(f"sbatch printed no job id: {submitted.stdout.strip()!r}")
    return job_id


def cancel(job_ids: list[str], run: Callable = commands.run, check: bool = True) -> None:
    if job_ids:
        run(["scancel", *job_ids], check=check)


# sbatch --test-only: "Job 12 to start at 2026-11-27T10:00:00 using 8 processors on nodes node[1-2]
# in partition gpu" (22.05 to 26.05; "Unknown" where the scheduler has no plan for it yet).
TEST_ONLY = re.compile(r"to start at (\S+) using \d+ processors on nodes (\S+)")


@dataclass(frozen=True)
class StartPlan:
    """Slurm's word on a script it would accept: when it would start (None: no plan yet) and where."""
    start: float | None
    nodes: str


def test_only(script: Path, run: Callable = commands.run) -> StartPlan:
    """`sbatch --test-only`: when and where Slurm would start the script; ValueError with Slurm's
    reason where it never could."""
    result = run(["sbatch", "--test-only", str(script)], timeout=30, check=False)
    said = (result.stderr + result.stdout).strip()
    found = TEST_ONLY.search(said)
    if result.returncode != 0 or not found:
        raise ValueError(said.removeprefix("sbatch: error: ") or f"sbatch --test-only exited {result.returncode}")
    return StartPlan(commands.slurm_time(found.group(1)), found.group(2))
