"""`ft usage`: GPU-hours and cost per run, user, account or tier, with what faults cost (toolkit/account)."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from enum import StrEnum
from pathlib import Path

import typer

from toolkit.base.shared_dirs import login_name
from toolkit.cli.output import console, err_console, plain, print_json
from toolkit.runs.layout import RunLayout, RunSpecError


class By(StrEnum):
    run = "run"
    user = "user"
    account = "account"
    tier = "tier"


def usage(account: str = typer.Option(None, "--account", "-A", help="only this Slurm account's jobs"),
          user: str = typer.Option(None, "--user", "-u", help="only this user's jobs"),
          since: str = typer.Option(None, "--since", help="from this date (YYYY-MM-DD); default: this month's start"),
          until: str = typer.Option(None, "--until", help="up to this date (YYYY-MM-DD); default: now"),
          by: By = typer.Option(By.run, "--by", help="one row per run, user, account or tier"),
          cluster: str = typer.Option(None, "--cluster", "-c"),
          as_json: bool = typer.Option(False, "--json")) -> None:
    """GPU-hours of every job (by run: ft's runs, the rest in a row of their own), their cost, and the
    GPU-hours lost to platform faults Slurm confirms (refundable) apart from those lost to user errors."""
    from toolkit.account import usage as accounting
    from toolkit.base.errors import FtError
    from toolkit.cluster.profile import load_profile
    from toolkit.runs.store import RunStore

    profile = load_profile(cluster)
    start = accounting.parse_since(since, datetime.now())
    end = accounting.parse_date(until, "--until") if until else None
    store = RunStore.for_shared_root(profile.shared_root)
    try:
        folders = list(store.root.iterdir()) if store.root.is_dir() else []
    except OSError:  # a runs folder this user may not list: Slurm's figures alone
        folders = []
    readable = {path.name: path for path in folders if _readable(RunLayout(path).record)}
    events = None  # Slurm's node events: what confirms a fault
    try:
        kept = accounting.what_slurm_keeps()
        allocations = accounting.from_slurm(start, account=account, ft_only=False, by_comment=kept.keeps_comments,
                                            until=end)
    except FtError as exc:
        allocations = accounting.from_records(sorted(readable.items()), _gpus_of, time.time(), start, _limit_of)
        allocations = [accounting.within(a, start, end) for a in allocations]
        source = f"ft's run records (Slurm accounting did not answer: {exc.message})"
        notes = ["without accounting: each run's GPUs from its recipe (a run whose recipe is not yours to read is "
                 "left out), no user, account, tier or node; no fault is confirmed"]
    else:
        source, notes = "Slurm accounting (sacct)", kept.notes()
        try:
            events = accounting.node_events(start)
        except FtError as exc:
            notes.append(f"no fault is confirmed: Slurm's node events could not be read ({exc.message})")
    allocations = [a for a in allocations if (account is None or a.account == account.lower())
                   and (user is None or a.user == user)]
    held: dict[tuple[str, str], list] = {}
    for allocation in sorted(allocations, key=lambda a: a.start or 0):
        if allocation.run:
            held.setdefault((allocation.run, allocation.user), []).append(allocation)
    losses = {(run, who): accounting.losses(readable[run], mine, events) for (run, who), mine in held.items()
              if run in readable and _runs_these_jobs(readable[run], mine)}
    tiers = accounting.Tiers(
        {target.partition: tier for tier, target in profile.tiers.items()},
        {target.qos: tier for tier, target in profile.tiers.items() if target.qos},
        {tier: target.price_per_gpu_hour or 0.0 for tier, target in profile.tiers.items()},
        profile.price_per_gpu_hour or 0.0)
    rows = accounting.summarise(allocations, by.value, tiers, losses)
    quotas = profile.accounts if by == By.account else {}
    if as_json:
        print_json({"source": source, "notes": notes, "since": start, "until": end, "cluster": profile.name,
                    "price_per_gpu_hour": profile.price_per_gpu_hour, "by": by.value,
                    "rows": [row.to_dict() | _quota(quotas.get(row.key), row.gpu_hours) for row in rows]})
        return
    _table(rows, by.value, profile.name, start, quotas)
    err_console.print(f"source: {plain(source)}")
    for note in notes:
        err_console.print(f"  {plain(note)}")


def _quota(quota, used: float) -> dict:
    """An account's budget and cap beside its use, and whether it is over its budget (flagged)."""
    if quota is None:
        return {}
    over = quota.budget_gpu_hours is not None and used > quota.budget_gpu_hours
    return {"budget_gpu_hours": quota.budget_gpu_hours, "cap_gpu_hours": quota.cap_gpu_hours, "over_budget": over}


def _runs_these_jobs(run_dir: Path, allocations: list) -> bool:
    """Whether a run folder is the one these jobs ran: made by their user and recording each of them.
    The runs folder is every user's, and a job's name is its submitter's choice: what a folder says
    of faults counts for a job only where both agree (refunds are paid on it)."""
    try:
        owner = login_name(os.lstat(run_dir).st_uid)
        record = json.loads(RunLayout(run_dir).record.read_text())
        jobs = {str(job.get("job_id")) for job in record.get("jobs", [])}
    except (OSError, ValueError, AttributeError):
        return False
    users = {allocation.user for allocation in allocations if allocation.user}
    ran = {allocation.job_id for allocation in allocations}
    return owner is not None and (not users or users == {owner}) and ran <= jobs


def _readable(path: Path) -> bool:
    """Whether this user may read a run's record (another user's run folder is private to them)."""
    try:
        return path.is_file() and os.access(path, os.R_OK)
    except OSError:
        return False


def _limit_of(run_dir: Path) -> float:
    """A run's time limit in seconds (unbounded where its spec is unreadable)."""
    try:
        return RunLayout(run_dir).read_spec().recipe.resources.time_limit_seconds()
    except (RunSpecError, ValueError):  # a damaged or foreign spec: its limit is unknown
        return float("inf")


def _gpus_of(run_dir: Path) -> int | None:
    from toolkit.account.usage import allocated_gpus

    try:
        return allocated_gpus(RunLayout(run_dir).read_spec().recipe.resources)
    except RunSpecError:  # a damaged or foreign spec: its GPUs are unknown
        return None


def _table(rows, by: str, cluster: str, start: float, quotas: dict) -> None:
    from rich.table import Table

    def hours(value: float | None) -> str:
        return "-" if value is None else f"{value:,.2f}"

    def wait(value: float | None) -> str:
        return "-" if value is None else f"{value / 60:,.1f} min"

    def budget(row) -> str:
        limits = _quota(quotas.get(row.key), row.gpu_hours)
        if not limits or limits["budget_gpu_hours"] is None:
            return "-"
        return f"{limits['budget_gpu_hours']:g}" + (" [bold red]OVER[/]" if limits["over_budget"] else "")

    table = Table(title=f"GPU-hours on {plain(cluster)} since {datetime.fromtimestamp(start):%Y-%m-%d %H:%M}",
                  title_justify="left")
    columns = (by, *(("user",) if by == "run" else ()), "runs", "allocations", "GPU-hours", "cost", "refundable",
               "faults unconfirmed", "user errors", "wait, median", "longest", *(("budget",) if quotas else ()))
    for column in columns:
        table.add_column(column, justify="left" if column in (by, "user") else "right", overflow="fold")
    for row in rows:
        table.add_row(plain(row.key), *((plain(row.user),) if by == "run" else ()), str(len(row.runs - {""})),
                      str(row.allocations), hours(row.gpu_hours), "-" if row.cost is None else f"${row.cost:,.2f}",
                      hours(row.refundable_gpu_hours), hours(row.unconfirmed_fault_gpu_hours),
                      hours(row.user_error_gpu_hours), wait(row.median_wait_s), wait(row.longest_wait_s),
                      *((budget(row),) if quotas else ()))
    console.print(table)
    if any(row.cost is None for row in rows):
        console.print("cost: '-' where the cluster profile sets no price_per_gpu_hour (nor the tier its own)")
