"""An account's share, checked before a run is submitted: its monthly GPU-hour cap (refused past it,
as Slurm would hold the job: GrpTRESMins with AccountingStorageEnforce=safe), its budget (warned and
flagged past it) and the runs it may have running at once (warned: the job waits in the queue).

The quotas are the cluster profile's `accounts` (written by ansible/roles/ft_profile from the same
inventory that sets Slurm's own limits); the usage is Slurm's accounting this month, every job of the
account (ft's or not: Slurm counts them all). Where accounting does not answer, nothing is checked:
Slurm could not enforce a cap either.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime

from toolkit.account import usage
from toolkit.base.errors import FtError
from toolkit.slurm import accounting, commands, jobs
from toolkit.slurm.site import SchedulerSite


class QuotaExceeded(FtError):
    exit_code = 2


def account_of(resources, profile: SchedulerSite, run: Callable = commands.run) -> str | None:
    """The account a job is charged to: the recipe's, the profile's default, else the user's own default."""
    if resources.account or profile.default_account:
        return (resources.account or profile.default_account).lower()  # Slurm's account names are lowercase
    try:
        found = accounting.default_account(run=run)
    except FtError:
        return None
    return found.lower() if found else None


def queued(account: str, run: Callable = commands.run, now: float | None = None) -> tuple[float, float, int]:
    """The account's jobs in the queue: the GPU-hours its running jobs may still use (until their
    time limits), those its pending jobs may use (whole), and how many run. Zeros where Slurm does
    not answer."""
    try:
        listed = jobs.queue(run, account=account)
    except (FtError, ValueError):
        return 0.0, 0.0, 0
    now = time.time() if now is None else now
    running_left, pending, running = 0.0, 0.0, 0
    for job in listed:
        if job.state == "RUNNING":
            running += 1
            running_left += job.gpus * max((job.end_time or 0.0) - now, 0.0) / 3600
        elif job.state == "PENDING":
            pending += job.gpus * (job.time_limit_min / 60 if job.time_limit_min and job.time_limit_min > 0 else 0.0)
    return running_left, pending, running


def slurms_count(account: str, run: Callable = commands.run) -> tuple[float, float] | None:
    """Slurm's own count for the account, as it enforces the cap: GPU-hours used this period and those
    its running jobs may still use (its association manager's; None where not shown to this user)."""
    try:
        minutes = accounting.assoc_gpu_minutes(account, run)
    except FtError:
        return None
    return None if minutes is None else (minutes[0] / 60, minutes[1] / 60)


def check(resolved, run: Callable = commands.run, now: float | None = None) -> list[str]:
    """Warnings for the submit, or QuotaExceeded where the run would pass its account's cap."""
    resources, profile = resolved.recipe.resources, resolved.profile
    account = account_of(resources, profile, run)
    quota = {name.lower(): value for name, value in profile.accounts.items()}.get(account) if account else None
    if quota is None:
        return []
    now = time.time() if now is None else now
    try:
        allocations = usage.from_slurm(usage.month_start(datetime.fromtimestamp(now)), run, ft_only=False,
                                       account=account)  # one account's month only
    except FtError:
        return []
    # What ran this month, and what runs or waits now up to its time limit (Slurm holds that much back);
    # Slurm's own count where it shows it (it tallies every few minutes, ft's sum is up to the second:
    # the larger of the two is what the next job meets).
    running_left, pending, running = queued(account, run, now)
    counted = sum(allocation.gpu_hours for allocation in allocations if allocation.account == account) + running_left
    slurms = slurms_count(account, run)
    used = max(counted, sum(slurms) if slurms else 0.0) + pending
    gpus = usage.allocated_gpus(resources)
    asks = gpus * resources.time_limit_seconds() / 3600
    if quota.cap_gpu_hours is not None and used + asks > quota.cap_gpu_hours:
        raise QuotaExceeded(
            f"account {account} has used {used:,.2f} of its {quota.cap_gpu_hours:g} GPU-hours this month; this run "
            f"may use up to {asks:,.2f} more ({gpus} GPUs for {resources.time}): Slurm would hold it "
            "(AssocGrpGRESMinutes), so nothing was submitted",
            hint="ask for less time (resources.time), use another account (resources.account), or ask the "
                 "cluster's admins for a higher cap (cap_gpu_hours)")
    warnings = []
    if slurms is None and private_jobs(run):
        warnings.append(f"other users' jobs are private on this cluster (PrivateData): the {used:,.2f} GPU-hours "
                        f"ft counts for account {account} may be only yours; Slurm still holds a job past the cap")
    if quota.budget_gpu_hours is not None and used + asks > quota.budget_gpu_hours:
        warnings.append(f"account {account} passes its monthly budget: {used:,.2f} of {quota.budget_gpu_hours:g} "
                        f"GPU-hours used, and this run may use {asks:,.2f} more (flagged in `ft usage --by account`)")
    if quota.max_running_jobs is not None and running >= quota.max_running_jobs:
        warnings.append(f"account {account} has {running} jobs running, its limit: this run waits in "
                        "the queue until one ends (AssocGrpJobsLimit)")
    return warnings


def private_jobs(run: Callable) -> bool:
    """Whether sacct may hide other users' jobs from this one (PrivateData=jobs or usage)."""
    try:
        return usage.what_slurm_keeps(run).hides_others
    except FtError:
        return False
