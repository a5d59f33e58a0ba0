"""ft from Python (notebooks, scripts): `toolkit.submit(recipe)` returns a Run handle.

    import toolkit
    run = toolkit.submit("recipes/tiny-lora-sft.yaml", idempotency_key="exp-42")
    run.wait()
    print(run.state, run.log())
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from toolkit.runs.status import RunStatus, job_of, log_path, run_status
from toolkit.runs.store import RunStore
from toolkit.slurm.client import SlurmClient, default_client


@dataclass
class Run:
    run_id: str
    run_dir: Path
    store: RunStore
    client: SlurmClient

    @property
    def job_id(self) -> str | None:
        return self.store.load(self.run_id).latest_job

    def status(self) -> RunStatus:
        return run_status(self.store, self.run_id, self.client)

    @property
    def state(self) -> str:
        return self.status().state

    def wait(self, timeout: float | None = None, poll: float = 2.0,
             on_state: Callable[[RunStatus], None] = lambda status: None) -> RunStatus:
        """Block until the run's job has finished (or `timeout` seconds passed: TimeoutError)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            current = self.status()
            on_state(current)
            if current.job and current.job.finished:
                return current
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"run {self.run_id} still {current.state} after {timeout} s")
            time.sleep(poll)

    def log(self, node: str | None = None, rank: int | None = None) -> str:
        path = log_path(self.run_dir, job_of(self.store.load(self.run_id), self.client), node, rank)
        return path.read_text(errors="replace") if path.exists() else ""

    def cancel(self) -> None:
        if self.job_id:
            self.client.cancel([self.job_id])


def submit(recipe: str | Path, cluster: str | None = None, idempotency_key: str | None = None,
           preflight: bool = False, skip_validation: bool = False) -> Run:
    from toolkit.submission import submit as submit_run

    submission = submit_run(Path(recipe), cluster, idempotency_key, mode="preflight" if preflight else "train",
                            skip_validation=skip_validation)
    store = RunStore(submission.run_dir.parent)
    return Run(submission.run.run_id, submission.run_dir, store, default_client())


def run(run_id: str, cluster: str | None = None) -> Run:
    """A handle on an existing run."""
    from toolkit.cluster.profile import load_profile

    store = RunStore.for_shared_root(load_profile(cluster).shared_root)
    store.load(run_id)  # raises RunNotFound with the runs that exist
    return Run(run_id, store.run_dir(run_id), store, default_client())
