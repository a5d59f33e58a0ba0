"""The wheelhouse a user's pip reads in tests/lab/test_user_setup.py: every wheel ft[train] needs,
and ft's build backend, gathered as root through the package index. A minute of pip that waits on
no Slurm job, so the lab session starts it beside its first tests (tests/lab/conftest.py) and the
test that needs it takes it when done."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from tests.support import streams
from toolkit.base.cache_entries import exclusive

REPO = Path(__file__).resolve().parents[2]
_gathering: dict[str, Future] = {}
_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-test-wheelhouse")


def gather(folder: Path) -> Path:
    """Once per test run, whichever lab stream asks first (tests/support/streams.py)."""
    folder.mkdir(parents=True, exist_ok=True)
    with exclusive(folder.parent / f"{folder.name}.lock"):
        mark = folder / f".gathered-{streams.run_id()}"
        if not (streams.run_id() and mark.exists()):
            pip_gather(folder)
            mark.touch()
    return folder


def pip_gather(folder: Path) -> None:
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    done = subprocess.run([*pip, "wheel", "--quiet", "-c", str(REPO / "constraints.txt"), "-w", str(folder),
                           f"{REPO}[train]", "hatchling", "editables", "pip", "setuptools", "wheel"],
                          capture_output=True, text=True, env={**os.environ, "DS_BUILD_OPS": "0"}, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"pip wheel failed:\n{done.stderr[-3000:]}")
    for built in [*folder.glob("ft-*.whl"), *folder.glob("deepspeed-*.whl")]:
        built.unlink()  # the user builds her own ft from her clone, and deepspeed from its source
    version = next(line for line in (REPO / "constraints.txt").read_text().splitlines()
                   if line.startswith("deepspeed==")).split("==")[1]
    done = subprocess.run([*pip, "download", "--quiet", "--no-deps", "--no-binary", "deepspeed", "-d", str(folder),
                           f"deepspeed=={version}"], capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"pip download failed:\n{done.stderr[-3000:]}")
    subprocess.run(["chmod", "-R", "a+rX", str(folder.parent)], check=True)


def begin(folder: Path) -> Future:
    """Start gathering into `folder` in the background (once)."""
    key = str(folder)
    if key not in _gathering:
        _gathering[key] = _pool.submit(gather, folder)
    return _gathering[key]


def gathered(folder: Path) -> Path:
    """The folder, once gathered (begun now when nothing began it earlier)."""
    return begin(folder).result(timeout=900)


def folder_of(shared_dir: str) -> Path:
    return Path(shared_dir) / "tests" / "carol-wheelhouse"
