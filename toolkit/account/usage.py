"""GPU-hours from Slurm's accounting: every allocation of every ft run (a requeue, a preemption and a
node failure each end one and start another), each counted once, priced at the cluster's rate.

Slurm keeps one record per allocation of a job (`sacct --duplicates`: a requeued job's earlier
allocations are kept under the same id, in state REQUEUED). An allocation's GPU-hours are its
allocated GPUs (AllocTRES gres/gpu) times its elapsed time. A restart within an allocation (a rank
hung or died: ft restarts it on the same nodes) is part of that allocation, never a second count.

Where Slurm keeps no accounting, the run records stand in (attempts.jsonl: each allocation's start and
nodes, the job's GPUs from its recipe), and `ft usage` says which it used.

Each allocation's wait (eligible to start: a premium tier's promise) is kept beside it.

What faults cost, from each run's own timeline (toolkit/runs/timeline.py), in the run's GPUs:
  refundable   lost to the platform: steps redone after a fault, detecting it and starting again
               (a node lost or silent, a rank died or hung)
  user error   the allocation a user error ended (a NaN loss, bad data, out of memory): its
               training is not kept
"""

from __future__ import annotations

import os
import re
import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path

from toolkit.base.errors import FtError
from toolkit.slurm import accounting, commands, job_comment
from toolkit.slurm import nodes as slurm_nodes

JOB_NAME = re.compile(r"ft-([A-Za-z0-9][A-Za-z0-9._-]*)")
USER_ERRORS = {4, 5}  # toolkit/runs/exits.py: USER_ERROR, OUT_OF_MEMORY


@dataclass(frozen=True)
class Allocation:
    """One allocation of a run's job: what Slurm (or the run's records) says it held and for how long."""
    run: str
    job_id: str
    user: str
    account: str
    partition: str
    state: str
    gpus: int
    seconds: float
    start: float | None
    waited: float | None = None  # from eligible to start: the queue's wait (a requeue's own, too)
    qos: str = ""
    nodes: tuple[str, ...] = ()

    @property
    def end(self) -> float | None:
        return None if self.start is None else self.start + self.seconds

    @property
    def gpu_hours(self) -> float:
        return self.gpus * self.seconds / 3600


def allocated_gpus(resources) -> int:
    """The GPUs a job of these resources holds: its spare nodes' too (a spare is allocated, and billed)."""
    return (resources.nodes + resources.spare_nodes) * (resources.gpus_per_node or 0)


@dataclass
class Losses:
    """A run's GPU-hours lost to faults, by who is to blame (None: its records are not readable here).
    refundable: lost to faults Slurm's own node events confirm; unconfirmed: lost to faults only the
    run's records tell of (a rank's own crash or hang, or a record written to claim a refund)."""
    refundable: float | None = None
    user_error: float | None = None
    unconfirmed: float | None = None


@dataclass(frozen=True)
class NodeEvent:
    """A node going down or drained, as slurmdbd recorded it (`sacctmgr show event`): Slurm's, its
    health check's or an admin's word, never a job user's."""
    node: str
    start: float


CONFIRMS_WITHIN_S = 300.0  # a node event this close to a fault episode confirms it
# What a confirmed fault may cost around its node event: the steps redone since the last checkpoint
# before it, and the detection, wait and restart after it. Beyond, the run's own records say alone.
REDONE_MAX_S = 3600.0
RECOVERY_MAX_S = 1800.0


@dataclass(frozen=True)
class Accounting:
    """What this Slurm keeps and shows: job comments (how a job is known as a run's), and whether
    other users' jobs are private (PrivateData=jobs or usage: sacct shows a user below Slurm's
    operators only their own)."""
    keeps_comments: bool
    private_jobs: bool

    @classmethod
    def of(cls, config: dict[str, str]) -> Accounting:
        private = set(config.get("PrivateData", "").split(","))
        return cls("job_comment" in config.get("AccountingStoreFlags", ""), bool(private & {"jobs", "usage"}))

    @property
    def hides_others(self) -> bool:
        """Whether sacct may leave other users' jobs out for this user (root sees them all)."""
        return self.private_jobs and os.geteuid() != 0

    def notes(self) -> list[str]:
        """How `ft usage` found its figures, beside its source."""
        said = ["ft's jobs by their comment" if self.keeps_comments else
                "ft's jobs by their name ft-<run>: this Slurm keeps no job comments "
                "(AccountingStoreFlags=job_comment)"]
        if self.hides_others:
            said.append("other users' jobs are private here (PrivateData): unless you are a Slurm operator, "
                        "only your own are counted")
        return said


def run_of(job: accounting.AccountedJob, by_comment: bool) -> str | None:
    """The run a job of sacct's is of: its comment's where Slurm keeps comments (a name is anyone's
    to give, and cut at Slurm's length), else its name's, ft-<run>."""
    if by_comment:
        return job_comment.run_of(job.comment)
    named = JOB_NAME.fullmatch(job.name)
    return named.group(1) if named else None


def allocations_of(jobs: list[accounting.AccountedJob], ft_only: bool = True,
                   by_comment: bool = True) -> list[Allocation]:
    """Slurm's allocations as ft counts them: ft's jobs only, or every job (a job not ft's has no
    run: ""). A pending job has held nothing yet."""
    found = []
    for job in jobs:
        run = run_of(job, by_comment)
        if (ft_only and run is None) or job.elapsed_s is None:
            continue
        waited = max(job.start - job.eligible, 0.0) if job.start is not None and job.eligible is not None else None
        found.append(Allocation(run or "", job.job_id, job.user, job.account, job.partition, job.state, job.gpus,
                                float(job.elapsed_s), job.start, waited, job.qos, job.nodes))
    return found


def what_slurm_keeps(run: Callable = commands.run) -> Accounting:
    """What this Slurm keeps (FtError where it does not answer)."""
    return Accounting.of(slurm_nodes.config(run))


def from_slurm(since: float, run: Callable = commands.run, ft_only: bool = True,
               account: str | None = None, by_comment: bool = True, until: float | None = None) -> list[Allocation]:
    """Every allocation of ft's jobs (or of all jobs; of one account's) between `since` and `until`
    (default: now), each clipped to the period, from slurmdbd; FtError where accounting is off."""
    jobs = accounting.allocations(since, until, account, run)
    return [within(allocation, since, until) for allocation in allocations_of(jobs, ft_only, by_comment)]


def within(allocation: Allocation, since: float, until: float | None = None) -> Allocation:
    """The part of an allocation inside the period (a job running across the month's start is charged
    to each month its own part, as Slurm's usage counts it)."""
    if allocation.start is None:
        return allocation
    begin = max(allocation.start, since)
    end = allocation.end if until is None else min(allocation.end, until)
    if (begin, end) == (allocation.start, allocation.end):
        return allocation
    return replace(allocation, seconds=max(end - begin, 0.0), start=begin)


def from_records(runs: Iterable[tuple[str, Path]], gpus_of: Callable[[Path], int | None], now: float,
                 since: float, limit_of: Callable[[Path], float] = lambda _: float("inf")) -> list[Allocation]:
    """The allocations the run records describe (attempts.jsonl: a line per start; `restart` 0 opens
    an allocation), each until the next opened or the job's last event, and never past its time
    limit (`limit_of`, seconds). Less exact than Slurm's (a job whose batch host died says nothing of
    its end): used only without accounting."""
    from toolkit.runs.layout import RunLayout
    from toolkit.runs.timeline import read_lines

    found = []
    for run_id, run_dir in runs:
        layout, gpus = RunLayout(run_dir), gpus_of(run_dir)
        if gpus is None:  # its recipe is not readable here: what it held is unknown, not nothing
            continue
        opened = [a for a in read_lines(layout.attempts, {"job_id": str, "started": (int, float)})
                  if a.get("restart", 0) == 0]
        events = read_lines(layout.events, {"time": (int, float), "event": str})
        for index, attempt in enumerate(opened):
            later = [e["time"] for e in events if e.get("job") == attempt["job_id"] and e["time"] >= attempt["started"]]
            end = opened[index + 1]["started"] if index + 1 < len(opened) else max(later, default=now)
            end = min(end, attempt["started"] + limit_of(run_dir))  # Slurm ends a job at its limit
            if end < since:
                continue
            found.append(Allocation(run_id, attempt["job_id"], "", "", "", "", gpus,
                                    max(end - max(attempt["started"], since), 0.0), attempt["started"]))
    return found


def node_events(since: float, run: Callable = commands.run) -> list[NodeEvent]:
    """Every node event since `since` (down, drained, failing); FtError where accounting is off."""
    return [NodeEvent(node, began) for node, began in accounting.node_events(since - CONFIRMS_WITHIN_S, run)]


def losses(run_dir: Path, allocations: list[Allocation], events: list[NodeEvent] | None) -> Losses:
    """What faults cost the run, in GPU-hours: each fault episode's lost time (its timeline's: the
    wait to the next start, that start, the steps redone) while an allocation held GPUs, times that
    allocation's GPUs; refundable where a node event of Slurm's on one of the allocation's nodes
    confirms it (`events`; None: Slurm could not be asked, nothing is confirmed). And the time of the
    allocation a user error ended. Never more than the allocations held. Allocations clipped to the
    period give the period's share."""
    from toolkit.runs.timeline import timeline

    try:
        spent = timeline(run_dir)
    except OSError:
        return Losses()
    held = [a for a in allocations if a.start is not None]
    if spent is None or not held:
        return Losses(0.0, 0.0, 0.0)
    confirmed = unconfirmed = 0.0  # GPU-seconds
    for episode in spent["episodes"]:
        for allocation in held:
            cost = allocation.gpus * sum(overlap(span, [(allocation.start, allocation.end)])
                                         for span in episode["spans"])
            window = confirmed_window(events or [], episode, allocation)
            vouched = 0.0 if window is None else allocation.gpus * sum(
                overlap(span, [(max(allocation.start, window[0]), min(allocation.end, window[1]))])
                for span in episode["spans"])
            confirmed += vouched
            unconfirmed += cost - vouched
    total = sum(a.gpus * a.seconds for a in held)
    confirmed = min(confirmed, total)
    unconfirmed = min(unconfirmed, total - confirmed)
    last, user_error = spent["last_end"], 0.0
    if last and last["code"] in USER_ERRORS:
        user_error = sum(a.gpus * overlap((last["began"], last["time"]), [(a.start, a.end)]) for a in held)
    return Losses(*(round(seconds / 3600, 4) for seconds in (confirmed, user_error, unconfirmed)))


def confirmed_window(events: list[NodeEvent], episode: dict, allocation: Allocation) -> tuple[float, float] | None:
    """The part of time Slurm's own records vouch for, or None: a node event (down, drained) on one
    of the allocation's own nodes (Slurm's node list, never one the run's records name: those are
    the user's word) around the episode's fault; from the work a fault makes redo before it
    (REDONE_MAX_S) to the recovery after it (RECOVERY_MAX_S). An episode's spans outside it, or
    with no such event, are unconfirmed, whatever the run's records say."""
    since = episode["time"] - CONFIRMS_WITHIN_S
    until = (episode["spans"][0][1] if episode["spans"] else episode["time"]) + CONFIRMS_WITHIN_S
    starts = [event.start for event in events if event.node in allocation.nodes and since <= event.start <= until]
    return (min(starts) - REDONE_MAX_S, max(starts) + RECOVERY_MAX_S) if starts else None


def overlap(span: tuple[float, float] | list[float], held: list[tuple[float, float]]) -> float:
    """Seconds of `span` inside the allocations' intervals (which never overlap one another)."""
    since, to = span
    return sum(max(min(to, end) - max(since, start), 0.0) for start, end in held)


NOT_FT = "(not ft)"  # the run row of jobs that are not ft's: every GPU-hour is in some row


@dataclass
class Row:
    key: str
    user: str | None = None  # a run's row: its user (two users' runs of one name are two rows)
    runs: set[str] = field(default_factory=set)
    allocations: int = 0
    gpu_hours: float = 0.0
    cost: float | None = 0.0
    refundable_gpu_hours: float | None = 0.0
    unconfirmed_fault_gpu_hours: float | None = 0.0
    user_error_gpu_hours: float | None = 0.0
    waits: list[float] = field(default_factory=list)  # each allocation's wait in the queue

    @property
    def median_wait_s(self) -> float | None:
        return statistics.median(self.waits) if self.waits else None

    @property
    def longest_wait_s(self) -> float | None:
        return max(self.waits) if self.waits else None

    def to_dict(self) -> dict:
        row = {key: value for key, value in asdict(self).items() if key not in ("waits", "user")}
        return row | {"runs": len(self.runs - {""}), "gpu_hours": round(self.gpu_hours, 4),
                      "cost": None if self.cost is None else round(self.cost, 2),
                      "median_wait_s": self.median_wait_s, "longest_wait_s": self.longest_wait_s} \
            | ({"user": self.user} if self.user is not None else {})


@dataclass(frozen=True)
class Tiers:
    """What the profile says of its tiers: a partition's tier (each slice's partitions too), a QOS's
    tier, and each tier's price per GPU-hour (0: none set)."""
    of_partition: dict[str, str]
    of_qos: dict[str, str]
    price: dict[str, float]
    default_price: float = 0.0

    def tier(self, allocation: Allocation) -> str:
        """The tier a job was served in: its partition's (its priority and preemption are the
        partition's; a cheaper QOS asked for on a dearer partition buys nothing), else its QOS's."""
        return (self.of_partition.get(allocation.partition) or self.of_qos.get(allocation.qos)
                or allocation.partition or "-")

    def price_of(self, allocation: Allocation) -> float:
        return self.price.get(self.tier(allocation)) or self.default_price


def summarise(allocations: list[Allocation], by: str, tiers: Tiers, run_losses: dict[tuple[str, str], Losses]
              ) -> list[Row]:
    """Rows per `by` (run, user, account, tier), largest first; every job in some row (by run, the
    jobs not ft's in one row per user). A run is one user's: a job of another user naming the same
    run is a row of its own. A run's losses count in the row of its latest allocation (a run moves
    between rows only if requeued to another tier). Cost at each allocation's tier's price (none
    where no price is set)."""
    def key_of(allocation: Allocation) -> str:
        if by == "tier":
            return tiers.tier(allocation)
        if by == "run":
            return allocation.run or NOT_FT
        return getattr(allocation, by) or "-"  # user, account

    def row_of(allocation: Allocation) -> tuple[str, str]:
        return key_of(allocation), allocation.user if by == "run" else ""

    rows: dict[tuple[str, str], Row] = {}
    latest: dict[tuple[str, str], Allocation] = {}
    for allocation in allocations:
        row = rows.setdefault(row_of(allocation), Row(key_of(allocation), allocation.user if by == "run" else None))
        row.runs.add(allocation.run)
        row.allocations += 1
        row.gpu_hours += allocation.gpu_hours
        price = tiers.price_of(allocation)
        row.cost = None if row.cost is None or not price else row.cost + allocation.gpu_hours * price
        if allocation.waited is not None:
            row.waits.append(allocation.waited)
        run = (allocation.run, allocation.user)
        if allocation.run and (run not in latest or (allocation.start or 0) >= (latest[run].start or 0)):
            latest[run] = allocation
    for run, allocation in latest.items():
        row, lost = rows[row_of(allocation)], run_losses.get(run, Losses())
        row.refundable_gpu_hours = add(row.refundable_gpu_hours, lost.refundable)
        row.unconfirmed_fault_gpu_hours = add(row.unconfirmed_fault_gpu_hours, lost.unconfirmed)
        row.user_error_gpu_hours = add(row.user_error_gpu_hours, lost.user_error)
    return sorted(rows.values(), key=lambda row: (-row.gpu_hours, row.key, row.user or ""))


def add(total: float | None, value: float | None) -> float | None:
    return None if total is None or value is None else round(total + value, 4)


def month_start(now: datetime) -> float:
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0).timestamp()


def parse_since(text: str | None, now: datetime) -> float:
    return month_start(now) if not text else parse_date(text, "--since")


def parse_date(text: str, flag: str) -> float:
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise FtError(f"{flag} {text!r} is not a date", hint="give it as YYYY-MM-DD (or YYYY-MM-DDTHH:MM)") from None
