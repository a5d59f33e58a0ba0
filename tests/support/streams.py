"""The lab tests run as two pytest-xdist workers, each in its own lab slice (scripts/test.sh): what
the whole run needs once (the session's uninterrupted baseline run, the user-setup test's
wheelhouse) is made by whichever worker asks first, under a lock, and shared through a file."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from toolkit.base.cache_entries import exclusive


def run_id() -> str | None:
    """This test run's id, the same in every worker (None without pytest-xdist)."""
    return os.environ.get("PYTEST_XDIST_TESTRUNUID")


def once(folder: Path, name: str, make: Callable[[], Any]) -> Any:
    """`make()`'s JSON result, made once per test run in `folder` (a failure is not kept: the next
    worker to ask tries again)."""
    if run_id() is None:
        return make()
    folder.mkdir(parents=True, exist_ok=True)
    done = folder / f"{name}.{run_id()}.json"
    with exclusive(folder / f"{name}.lock"):  # each worker is a process of its own
        if done.is_file():
            return json.loads(done.read_text())
        value = make()
        done.write_text(json.dumps(value))
        return value
