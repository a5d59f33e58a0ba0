"""A run's state, as Slurm sees it now, and where its logs are."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from toolkit.base.shared_dirs import open_regular
from toolkit.runs.layout import RunLayout, RunSpecError
from toolkit.runs.store import RunRecord, RunStore
from toolkit.runs.timeline import read_lines, timeline
from toolkit.slurm.client import JobInfo, SlurmClient
from toolkit.slurm.commands import SlurmCommandError, SlurmUnavailable


@dataclass
class RunStatus:
    run: RunRecord
    run_dir: Path
    job: JobInfo | None
    attempts: list[dict]
    tracking: dict | None = None  # where the run's metrics are (W&B page, or offline folder)
    summary: dict | None = None
    timeline: dict | None = None  # where the time went: goodput, faults (toolkit/runs/timeline.py)
    checkpoints: dict | None = None  # the newest checkpoint in each tier (toolkit/checkpoint/status.py)
    evaluation: dict | None = None  # the trained model against the base, the gates (toolkit/evaluate/)

    @property
    def state(self) -> str:
        return self.job.state if self.job else "UNKNOWN"

    @property
    def tier(self) -> str:
        """The service tier the run asked for (its recipe's resources.tier); '' where unreadable."""
        try:
            return str(RunLayout(self.run_dir).read_spec().recipe.resources.tier)  # a str, or a Tier (a StrEnum)
        except RunSpecError:  # a damaged or foreign spec: the run is still listed
            return ""

    def to_dict(self) -> dict:
        return {"run_id": self.run.run_id, "state": self.state, "run_dir": str(self.run_dir),
                "cluster": self.run.cluster, "recipe": self.run.recipe_name, "mode": self.run.mode, "tier": self.tier,
                "idempotency_key": self.run.idempotency_key,
                "jobs": [asdict(job) for job in self.run.jobs],
                "job": asdict(self.job) if self.job else None, "attempts": self.attempts,
                "tracking": self.tracking, "summary": self.summary, "timeline": self.timeline,
                "checkpoints": self.checkpoints, "evaluation": self.evaluation}


ATTEMPT_FIELDS = {"job_id": str, "restart": int, "nodes": list, "started": (int, float)}


def read_attempts(run_dir: Path) -> list[dict]:
    """One entry per start of the job. A torn or foreign line (a node lost mid-write) is skipped:
    it never hides the other attempts, nor breaks `ft ls` for every run."""
    return read_lines(RunLayout(run_dir).attempts, ATTEMPT_FIELDS)


MAX_RUN_FILE_BYTES = 4 << 20  # a run's JSON files (summary, evaluation) are a few KiB


def read_json(path: Path) -> dict | None:
    """A JSON object from a run's file; None for anything else (missing, torn, a list, nested without
    end, a FIFO or a device in its place, larger than any ft writes)."""
    try:
        with open_regular(path) as handle:
            value = json.loads(handle.read(MAX_RUN_FILE_BYTES + 1))  # larger: cut, and no JSON
    except (OSError, ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def queued_runs(client: SlurmClient) -> dict[str, str]:
    """Run id -> job id of this user's queued jobs; empty when Slurm does not answer (a run's record
    is still shown)."""
    try:
        return client.queued_runs()
    except (SlurmUnavailable, SlurmCommandError):
        return {}


def job_of(record: RunRecord, client: SlurmClient, queued: dict[str, str] | None = None) -> str | None:
    """The run's latest job: recorded, or, for a script submitted with plain sbatch whose job has
    not started (and so not registered itself) yet, found in the queue by its comment."""
    if record.latest_job:
        return record.latest_job
    return (queued if queued is not None else queued_runs(client)).get(record.run_id)


def run_status(store: RunStore, run_id: str, client: SlurmClient, queued: dict[str, str] | None = None) -> RunStatus:
    record = store.load(run_id)
    job_id = job_of(record, client, queued)
    job = client.job(job_id) if job_id else None
    run_dir = store.run_dir(run_id)
    layout = RunLayout(run_dir)
    summary = read_json(layout.summary)
    if summary:
        summary = {key: value for key, value in summary.items() if key != "loss_curve"}
    checkpoints = read_json(layout.checkpoint_status)
    return RunStatus(record, run_dir, job, read_attempts(run_dir), read_json(layout.tracking), summary,
                     timeline(run_dir), checkpoints if isinstance(checkpoints, dict) else None,
                     read_json(layout.evaluation))


def log_path(run_dir: Path, job_id: str | None, node: str | None = None, rank: int | None = None) -> Path:
    layout = RunLayout(run_dir)
    if node is not None:
        return layout.node_log(node)
    if rank is not None:
        return layout.rank_log(rank)
    return layout.slurm_log(job_id or "<no job yet>")
