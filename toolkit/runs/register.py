"""A job records itself in its run's record as it starts (`python -m toolkit.runs.register`, from
the job script): a script rendered with `ft render` and submitted with plain sbatch shows in
`ft ls` and `ft status` like one `ft submit` submitted. A record that is missing is made from the
run spec; a failure here never stops the job (the script goes on, saying so)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from toolkit.base.shared_dirs import private_dir
from toolkit.runs.layout import RunLayout
from toolkit.runs.store import JobRecord, RunRecord, RunStore


def register(run_dir: Path, run_id: str, job_id: str, mode: str) -> RunRecord:
    if run_dir.name != run_id:
        raise ValueError(f"the run directory {run_dir} is not run {run_id}'s")
    private_dir(run_dir)  # this user's alone (the job script checked it too): never a planted folder
    layout = RunLayout(run_dir)

    def adopt() -> RunRecord:
        recipe = layout.read_spec().recipe
        source = layout.recipe_source if layout.recipe_source.exists() else layout.spec
        return RunRecord(run_id, recipe.name, str(source), recipe.cluster or "", mode, time.time())

    return RunStore(run_dir.parent).add_job(run_id, JobRecord(job_id, time.time()), adopt)


def main() -> int:
    try:
        register(Path(os.environ["FT_RUN_DIR"]), os.environ["FT_RUN_ID"], os.environ["SLURM_JOB_ID"],
                 os.environ.get("FT_MODE", "train"))
    except Exception as exc:  # noqa: BLE001 - the record is for `ft status`; the job goes on without it
        print(f"ft: could not record job {os.environ.get('SLURM_JOB_ID')} in the run's record: {exc}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
