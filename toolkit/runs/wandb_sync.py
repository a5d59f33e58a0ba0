"""`ft sync RUN`: a run's offline W&B logs (compute nodes often reach no internet: the lab, air-gapped
sites) pushed to W&B from the login node, through W&B's own client (`wandb sync`). A start of the
run (each requeue, each restart) leaves its own offline folder; wandb marks each one it synced, so
`ft sync` again pushes only what is new."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from toolkit.base.errors import FtError
from toolkit.runs.layout import RunLayout


def offline_runs(run_dir: Path, include_synced: bool = False) -> list[Path]:
    """The run's offline W&B folders, oldest first; those wandb already synced left out."""
    found = sorted(RunLayout(run_dir).wandb.glob("offline-run-*"))
    return [folder for folder in found if folder.is_dir()
            and (include_synced or not any(folder.glob("*.wandb.synced")))]


def client_python(training_python: str) -> str:
    """An interpreter with W&B's client: this one, else the cluster's training environment
    (`ft cluster prepare` installs ft[train], wandb with it)."""
    if importlib.util.find_spec("wandb") is not None:
        return sys.executable
    if training_python and Path(training_python).exists():
        return training_python
    raise FtError("W&B's client (wandb) is not installed where ft runs, and the cluster has no prepared "
                  "training environment to borrow it from",
                  hint="pip install wandb into ft's environment, or run `ft cluster prepare CLUSTER` first")


SYNC_TIMEOUT_S = 3600  # wandb retries an unreachable server without end


def synced_at(folder: Path) -> float | None:
    """When wandb last marked the folder synced (its `.synced` file), None if never."""
    return max((mark.stat().st_mtime_ns for mark in folder.glob("*.wandb.synced")), default=None)


def sync(folders: list[Path], project: str, entity: str | None, python: str, run_dir: Path) -> list[Path]:
    """`wandb sync` of the folders (those synced before too), its output passed through (the run's
    page); the folders it did not mark synced this time are returned. wandb exits 0 when a folder
    failed (a refused key, a server error): its own mark, made now, is the verdict. W&B's key comes
    from the environment (WANDB_API_KEY) or `wandb login`: never from ft. Run in the run's folder:
    wandb writes its logs where it runs."""
    before = {folder: synced_at(folder) for folder in folders}
    argv = [python, "-m", "wandb", "sync", "--include-synced", "--project", project,
            *(["--entity", entity] if entity else []), *map(str, folders)]
    try:
        subprocess.run(argv, stdin=subprocess.DEVNULL, check=False, cwd=run_dir, timeout=SYNC_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise FtError(f"wandb sync did not finish within {SYNC_TIMEOUT_S // 60} minutes",
                      hint="is W&B reachable from here (WANDB_BASE_URL)? `ft sync` again resumes") from exc
    return [folder for folder in folders if synced_at(folder) in (None, before[folder])]
