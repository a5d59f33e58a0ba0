"""ft's word on its jobs: every job ft submits carries the comment `ft-run=<run>[,ft-key=<key>]`
(sbatch --comment). The comment, not the job's name, is how a job is known as a run's: anyone may
name a job `ft-<run>`, and a name is cut at Slurm's length. squeue shows the comment, sacct keeps it
where the cluster stores job comments (AccountingStoreFlags=job_comment)."""

from __future__ import annotations

from toolkit.base.names import RUN_ID_PATTERN


def compose(run_id: str, key: str | None = None) -> str:
    return f"ft-run={run_id}" + (f",ft-key={key}" if key else "")


def run_of(comment: object) -> str | None:
    """The run a job's comment names, or None (no comment, not ft's, or not a run's id)."""
    if not isinstance(comment, str):
        return None
    fields = dict(item.split("=", 1) for item in comment.split(",") if "=" in item)
    run_id = fields.get("ft-run", "")
    return run_id if RUN_ID_PATTERN.fullmatch(run_id) else None
