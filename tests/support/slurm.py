"""Small helpers for tests that drive Slurm directly (sbatch, scontrol, sacct)."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from toolkit.slurm import commands

T = TypeVar("T")


def sbatch(script: Path, *options: str) -> str:
    """Submit to the test's lab slice (its standard partition, set by the `lab` fixture) unless the
    options name a partition."""
    partition = os.environ.get("FT_TEST_PARTITION")
    if partition and not any(option.startswith(("--partition", "-p")) for option in options):
        options = (f"--partition={partition}", *options)
    result = commands.run(["sbatch", "--parsable", *options, str(script)])
    return result.stdout.strip().split(";")[0]


def heal(lab) -> None:
    """`ft lab up` for the test's share of the lab: its crashed nodes back, another slice's left to it."""
    from toolkit.lab import lifecycle

    outcome = lifecycle.up(only=[node.name for node in lab.nodes])
    assert outcome.status.healthy, outcome.status.problems


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job -o` as a dict (empty once the controller has forgotten the job)."""
    result = commands.run(["scontrol", "show", "job", "-o", job_id], check=False)
    fields: dict[str, str] = {}
    for token in result.stdout.split():
        key, sep, value = token.partition("=")
        if sep and key not in fields:
            fields[key] = value
    return fields


def hostnames(nodelist: str) -> list[str]:
    return commands.run(["scontrol", "show", "hostnames", nodelist]).stdout.split()


def cancel(*job_ids: str) -> None:
    if job_ids:
        commands.run(["scancel", *job_ids], check=False)


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, interval: float = 0.5) -> T:
    """Poll until `probe` returns something truthy; fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def write_script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\nset -euo pipefail\n" + body)
    path.chmod(0o755)
    subprocess.run(["bash", "-n", str(path)], check=True)
    return path
