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

import json
import os
import re
import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path

from toolkit.errors import FtError
from toolkit.slurm import commands, job_comment

JOB_NAME = re.compile(r"ft-([A-Za-z0-9][A-Za-z0-9._-]*)")
USER_ERRORS = {4, 5}  # toolkit/watch/exits.py: USER_ERROR, OUT_OF_MEMORY
# `--json`: a job's name and comment are its submitter's free text (a newline, any delimiter), which
# would forge or hide a line of sacct's text output. In JSON sacct lists every allocation.
SACCT = ["sacct", "--allusers", "--duplicates", "-X", "--json"]
# Matches a squeue or sacct `tres_req_str` / AllocTRES text: how many GPUs a job holds.
GPUS = re.compile(r"(?:^|,)gres/gpu=(\d+)(?:,|$)")


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

    @property
    def gpu_hours(self) -> float:
        return self.gpus * self.seconds / 3600


def allocated_gpus(resources) -> int:
    """The GPUs a job of these resources holds: its spare nodes' too (a spare is allocated, and billed)."""
    return (resources.nodes + resources.spare_nodes) * (resources.gpus_per_node or 0)


@dataclass
class Losses:
    """A run's GPU-hours lost to faults, by who is to blame (None: its records are not readable here)."""
    refundable: float | None = None
    user_error: float | None = None


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

    def notes(self) -> list[str]:
        """How `ft usage` found its figures, beside its source."""
        said = ["ft's jobs by their comment" if self.keeps_comments else
                "ft's jobs by their name ft-<run>: this Slurm keeps no job comments "
                "(AccountingStoreFlags=job_comment)"]
        if self.private_jobs and os.geteuid() != 0:
            said.append("other users' jobs are private here (PrivateData): unless you are a Slurm operator, "
                        "only your own are counted")
        return said


def run_of(job: dict, by_comment: bool) -> str | None:
    """The run a job of sacct's is of: its comment's where Slurm keeps comments (a name is anyone's
    to give, and cut at Slurm's length), else its name's, ft-<run>."""
    if by_comment:
        return job_comment.run_of(field_of(job, "comment", "job"))
    named = JOB_NAME.fullmatch(str(job.get("name") or ""))
    return named.group(1) if named else None


def field_of(job: dict, *keys: str) -> object:
    """A nested field of a job in Slurm's JSON (None where missing). Slurm 23.02+ wraps numbers as
    {"set": true, "number": N}; 22.05 gives N."""
    value: object = job
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    if isinstance(value, dict) and "number" in value:
        value = value["number"] if value.get("set", True) else None
    return value


def state_of(current: object) -> str:
    """A job's state: 22.05 gives a word, 23.02+ a list of them (the state, then its flags)."""
    if isinstance(current, list):
        current = current[0] if current else ""
    return str(current or "")


def parse_sacct(answer: object, ft_only: bool = True, by_comment: bool = True) -> list[Allocation]:
    """`sacct --json --duplicates` (Slurm 22.05's shape, 23.02's numbers too): every allocation once;
    ft's jobs only, or every job (each under its own name). A pending job has held nothing yet."""
    jobs = answer.get("jobs") if isinstance(answer, dict) else None
    found = []
    for job in jobs if isinstance(jobs, list) else []:
        if not isinstance(job, dict):
            continue
        run = run_of(job, by_comment)
        elapsed, began, ready = (field_of(job, "time", key) for key in ("elapsed", "start", "eligible"))
        if (ft_only and run is None) or not isinstance(elapsed, int) or elapsed < 0:
            continue
        tres = field_of(job, "tres", "allocated")
        gpus = sum(item.get("count") or 0 for item in (tres if isinstance(tres, list) else [tres])
                   if isinstance(item, dict) and item.get("type") == "gres" and item.get("name") == "gpu")
        began = float(began) if isinstance(began, int) and began > 0 else None
        ready = float(ready) if isinstance(ready, int) and ready > 0 else None
        waited = max(began - ready, 0.0) if began is not None and ready is not None else None
        found.append(Allocation(run or str(job.get("name") or ""), str(job.get("job_id", "")),
                                *(str(job.get(key) or "") for key in ("user", "account", "partition")),
                                state_of(field_of(job, "state", "current")), int(gpus), float(elapsed),
                                began, waited, str(job.get("qos") or "")))
    return found


def what_slurm_keeps(run: Callable = commands.run) -> Accounting:
    """What this Slurm keeps (FtError where it does not answer)."""
    return Accounting.of(commands.parse_config(run(["scontrol", "show", "config"], timeout=20).stdout))


def from_slurm(since: float, run: Callable = commands.run, ft_only: bool = True,
               account: str | None = None, by_comment: bool = True) -> list[Allocation]:
    """Every allocation of ft's jobs (or of all jobs; of one account's) since `since`, from slurmdbd;
    FtError where accounting is off."""
    start = datetime.fromtimestamp(since).strftime("%Y-%m-%dT%H:%M:%S")
    result = run([*SACCT, *([f"--accounts={account.lower()}"] if account else []),
                  f"--starttime={start}", "--endtime=now"], timeout=60)
    try:
        answer = json.loads(result.stdout)
    except ValueError as exc:
        raise FtError(f"sacct printed no JSON: {exc}") from None
    return [within(allocation, since) for allocation in parse_sacct(answer, ft_only, by_comment)]


def within(allocation: Allocation, since: float) -> Allocation:
    """The part of an allocation after `since` (a job running across the month's start is charged to
    each month its own part, as Slurm's usage counts it)."""
    if allocation.start is None or allocation.start >= since:
        return allocation
    return replace(allocation, seconds=max(allocation.start + allocation.seconds - since, 0.0), start=since)


def from_records(runs: Iterable[tuple[str, Path]], gpus_of: Callable[[Path], int], now: float,
                 since: float, limit_of: Callable[[Path], float] = lambda _: float("inf")) -> list[Allocation]:
    """The allocations the run records describe (attempts.jsonl: a line per start; `restart` 0 opens
    an allocation), each until the next opened or the job's last event, and never past its time
    limit (`limit_of`, seconds). Less exact than Slurm's (a job whose batch host died says nothing of
    its end): used only without accounting."""
    from toolkit.runs.layout import RunLayout
    from toolkit.runs.timeline import read_lines

    found = []
    for run_id, run_dir in runs:
        layout = RunLayout(run_dir)
        opened = [a for a in read_lines(layout.attempts, {"job_id": str, "started": (int, float)})
                  if a.get("restart", 0) == 0]
        events = read_lines(layout.events, {"time": (int, float), "event": str})
        for index, attempt in enumerate(opened):
            later = [e["time"] for e in events if e.get("job") == attempt["job_id"] and e["time"] >= attempt["started"]]
            end = opened[index + 1]["started"] if index + 1 < len(opened) else max(later, default=now)
            end = min(end, attempt["started"] + limit_of(run_dir))  # Slurm ends a job at its limit
            if end < since:
                continue
            found.append(Allocation(run_id, attempt["job_id"], "", "", "", "", gpus_of(run_dir),
                                    max(end - max(attempt["started"], since), 0.0), attempt["started"]))
    return found


def losses(run_dir: Path, allocations: list[Allocation]) -> Losses:
    """What faults cost the run, in GPU-hours: its timeline's lost time while an allocation held
    GPUs (a requeued job waiting in the queue holds none), and the time of the allocation a user
    error ended."""
    from toolkit.runs.timeline import timeline

    try:
        spent = timeline(run_dir)
    except OSError:
        return Losses()
    if spent is None or not allocations:
        return Losses(0.0, 0.0)
    gpus = allocations[-1].gpus
    held = [(a.start, a.start + a.seconds) for a in allocations if a.start is not None]
    waited = sum(overlap(span, held) for span in spent["recovering_spans"])
    # Steps and starts run inside an allocation; the files say how long, and never more than was held.
    refundable = min(spent["redone_s"] + spent["restarting_s"] + waited, sum(a.seconds for a in allocations))
    end = spent["last_end"]
    user_error = overlap((end["began"], end["time"]), held) if end and end["code"] in USER_ERRORS else 0.0
    return Losses(round(gpus * refundable / 3600, 4), round(gpus * user_error / 3600, 4))


def overlap(span: tuple[float, float] | list[float], held: list[tuple[float, float]]) -> float:
    """Seconds of `span` inside the allocations' intervals (which never overlap one another)."""
    since, to = span
    return sum(max(min(to, end) - max(since, start), 0.0) for start, end in held)


@dataclass
class Row:
    key: str
    runs: set[str] = field(default_factory=set)
    allocations: int = 0
    gpu_hours: float = 0.0
    refundable_gpu_hours: float | None = 0.0
    user_error_gpu_hours: float | None = 0.0
    waits: list[float] = field(default_factory=list)  # each allocation's wait in the queue

    @property
    def median_wait_s(self) -> float | None:
        return statistics.median(self.waits) if self.waits else None

    @property
    def longest_wait_s(self) -> float | None:
        return max(self.waits) if self.waits else None

    def to_dict(self, price: float) -> dict:
        row = {key: value for key, value in asdict(self).items() if key != "waits"} | {"runs": len(self.runs)}
        cost = round(self.gpu_hours * price, 2) if price else None  # no price: no cost, not a free run
        return row | {"gpu_hours": round(self.gpu_hours, 4), "cost": cost,
                      "median_wait_s": self.median_wait_s, "longest_wait_s": self.longest_wait_s}


def summarise(allocations: list[Allocation], by: str, tiers: dict[str, str],
              run_losses: dict[str, Losses], qos_tiers: dict[str, str] | None = None) -> list[Row]:
    """Rows per `by` (run, user, account, tier), largest first. A job's tier is its QOS's (`qos_tiers`:
    the tiers are QOS), else its partition's (`tiers`), else its partition. A run's losses count in the
    row of its latest allocation (a run moves between rows only if requeued to another tier)."""
    qos_tiers = qos_tiers or {}

    def key_of(allocation: Allocation) -> str:
        if by == "tier":
            return qos_tiers.get(allocation.qos) or tiers.get(allocation.partition, allocation.partition) or "-"
        return getattr(allocation, by) or "-"  # run, user, account

    rows: dict[str, Row] = {}
    latest: dict[str, Allocation] = {}
    for allocation in allocations:
        key = key_of(allocation)
        row = rows.setdefault(key, Row(key))
        row.runs.add(allocation.run)
        row.allocations += 1
        row.gpu_hours += allocation.gpu_hours
        if allocation.waited is not None:
            row.waits.append(allocation.waited)
        if allocation.run not in latest or (allocation.start or 0) >= (latest[allocation.run].start or 0):
            latest[allocation.run] = allocation
    for run, allocation in latest.items():
        row, lost = rows[key_of(allocation)], run_losses.get(run, Losses())
        row.refundable_gpu_hours = add(row.refundable_gpu_hours, lost.refundable)
        row.user_error_gpu_hours = add(row.user_error_gpu_hours, lost.user_error)
    return sorted(rows.values(), key=lambda row: (-row.gpu_hours, row.key))


def add(total: float | None, value: float | None) -> float | None:
    return None if total is None or value is None else round(total + value, 4)


def month_start(now: datetime) -> float:
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0).timestamp()


def parse_since(text: str | None, now: datetime) -> float:
    if not text:
        return month_start(now)
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise FtError(f"--since {text!r} is not a date", hint="give it as YYYY-MM-DD (or YYYY-MM-DDTHH:MM)") from None
