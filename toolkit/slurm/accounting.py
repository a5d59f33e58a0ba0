"""Slurm's accounting (slurmdbd): sacct's allocations, sacctmgr's events, users, accounts and QOS, and
the association manager's running count of an account's GPU-minutes.

Typed answers, the same on every Slurm version (toolkit/slurm/shapes.py); each function takes the
command runner (`run`), so unit tests give recorded answers instead. Each raises FtError where
accounting does not answer (off, or slurmdbd down), unless it says otherwise.
"""

from __future__ import annotations

import getpass
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from toolkit.slurm import commands, shapes


@dataclass(frozen=True)
class AccountedJob:
    """One allocation of a job (a requeued job's earlier ones are kept under the same id)."""
    job_id: str
    name: str
    comment: str  # the job's own (AccountingStoreFlags=job_comment), "" where Slurm keeps none
    user: str
    account: str
    partition: str
    qos: str
    state: str  # COMPLETED, REQUEUED, RUNNING, ...: the base state
    gpus: int  # allocated (gres/gpu in its TRES)
    elapsed_s: int | None
    start: float | None
    eligible: float | None
    nodes: tuple[str, ...]
    cluster: str = ""
    exit_code: int | None = None  # the batch script's return code


# `--json`: a job's name and comment are its submitter's free text (a newline, any delimiter), which
# would forge or hide a line of sacct's text output. In JSON sacct lists every allocation.
SACCT = ["sacct", "--allusers", "--duplicates", "-X", "--json"]


def parse_sacct(answer: object) -> list[AccountedJob]:
    """`sacct --json --duplicates`'s allocations, from any Slurm version's shape."""
    jobs = answer.get("jobs") if isinstance(answer, dict) else None
    found = []
    for job in jobs if isinstance(jobs, list) else []:
        if not isinstance(job, dict):
            continue
        elapsed = shapes.dig(job, "time", "elapsed")
        began, ready = (shapes.dig(job, "time", key) for key in ("start", "eligible"))
        comment = shapes.dig(job, "comment", "job")  # 22.05 on: {"job": ..., "administrator": ...}
        found.append(AccountedJob(
            job_id=str(shapes.dig(job, "job_id") or ""), name=shapes.text(job.get("name")),
            comment=shapes.text(comment), user=shapes.text(job.get("user")),
            account=shapes.text(job.get("account")), partition=shapes.text(job.get("partition")),
            qos=shapes.text(job.get("qos")), state=shapes.state(job.get("state")),
            gpus=shapes.tres_gpus(shapes.dig(job, "tres", "allocated")),
            elapsed_s=int(elapsed) if isinstance(elapsed, int | float) and elapsed >= 0 else None,
            start=float(began) if isinstance(began, int | float) and began > 0 else None,
            eligible=float(ready) if isinstance(ready, int | float) and ready > 0 else None,
            nodes=tuple(commands.expand_hostlist(shapes.text(job.get("nodes"))))
            if shapes.text(job.get("nodes")) != "None assigned" else (),
            cluster=shapes.text(job.get("cluster")),
            exit_code=code if isinstance(code := shapes.dig(job, "exit_code", "return_code"), int) else None,
        ))
    return found



def stamp(when: float) -> str:
    return datetime.fromtimestamp(when).strftime("%Y-%m-%dT%H:%M:%S")


def allocations(since: float, until: float | None = None, account: str | None = None,
                run: Callable = commands.run) -> list[AccountedJob]:
    """Every allocation of every user's jobs (one account's, where named) that overlaps the period."""
    argv = [*SACCT, *([f"--accounts={account.lower()}"] if account else []),
            f"--starttime={stamp(since)}", f"--endtime={stamp(until) if until else 'now'}"]
    return parse_sacct(commands.run_json(argv, timeout=60, runner=run))


def jobs_of(job_ids: list[str], run: Callable = commands.run) -> list[AccountedJob]:
    """Every allocation of these jobs."""
    return parse_sacct(commands.run_json([*SACCT, f"--jobs={','.join(job_ids)}"], timeout=30, runner=run))


def node_events(since: float, run: Callable = commands.run) -> list[tuple[str, float]]:
    """Every node event (down, drained, failing) that began since `since`: (node, start)."""
    result = run(["sacctmgr", "--noheader", "--parsable2", "show", "event", f"start={stamp(since)}",
                  "format=nodename,start"], timeout=30)
    found = []
    for line in result.stdout.splitlines():
        node, _, start = line.partition("|")
        began = commands.slurm_time(start.strip())
        if node and began is not None:  # a cluster's own events name no node
            found.append((node, began))
    return found


def default_account(user: str | None = None, run: Callable = commands.run) -> str | None:
    """The user's default account (None where accounting does not say)."""
    found = run(["sacctmgr", "--noheader", "--parsable2", "show", "user", user or getpass.getuser(),
                 "format=defaultaccount"], timeout=10).stdout.split()
    return found[0] if found else None


def qos_names(run: Callable = commands.run) -> list[str]:
    result = run(["sacctmgr", "--noheader", "--parsable2", "show", "qos", "format=Name"], timeout=20)
    return [line.strip() for line in result.stdout.splitlines() if line.strip()]


def user_associations(user: str, run: Callable = commands.run) -> dict[str, list[str]]:
    """account -> the QOS the user may use there, for each of the user's associations."""
    result = run(["sacctmgr", "--noheader", "--parsable2", "show", "associations", f"user={user}",
                  "format=Account,QOS"], timeout=20)
    found: dict[str, list[str]] = {}
    for line in result.stdout.splitlines():
        account, _, qos = line.strip().partition("|")
        if account:
            found.setdefault(account, [])
            found[account] += [q for q in qos.split(",") if q and q not in found[account]]
    return found


# scontrol show assoc_mgr: `GrpTRESMins=cpu=N(0),...,gres/gpu=60(12)`: the limit (N: none) and the
# minutes used; `GrpTRESRunMins=...,gres/gpu=N(90)`: what running jobs may still use.
ASSOC_GPU_MINUTES = re.compile(r"^\s*(GrpTRESMins|GrpTRESRunMins)=.*?(?:^|,|=)gres/gpu=(?:N|\d+)\((\d+)\)", re.M)


def assoc_gpu_minutes(account: str, run: Callable = commands.run) -> tuple[int, int] | None:
    """Slurm's own count for the account, as it enforces its cap: GPU-minutes used this period and
    those its running jobs may still use (None where the association manager does not show it)."""
    text = run(["scontrol", "show", "assoc_mgr", "flags=assoc", f"accounts={account}"], timeout=10).stdout
    return parse_assoc_gpu_minutes(text, account)


def parse_assoc_gpu_minutes(text: str, account: str) -> tuple[int, int] | None:
    # The account's own record (no user): the records after it are its users'.
    record = re.search(rf"^ClusterName=\S+ Account={re.escape(account)} UserName= .*?(?=^ClusterName=|\Z)",
                       text, re.M | re.S)
    counts = dict((name, int(minutes)) for name, minutes in ASSOC_GPU_MINUTES.findall(record.group(0))) \
        if record else {}
    if "GrpTRESMins" not in counts:
        return None
    return counts["GrpTRESMins"], counts.get("GrpTRESRunMins", 0)
