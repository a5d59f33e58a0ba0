"""Checks of the node itself: the checkpoint filesystem (free space, free inodes, and that it
answers at all: a hung Lustre mount blocks every save) and memory."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from toolkit.health.actions import Finding

MIN_FREE_FRACTION = 0.02
MIN_FREE_BYTES = 10 << 30
STAT_TIMEOUT_S = 10.0


def answers_within(path: str, timeout: float, probe: Callable[[str], object] = os.statvfs) -> bool:
    """Whether a statvfs of `path` returns in time. A thread, not the caller, waits on a hung
    mount: a stat in uninterruptible sleep cannot be cancelled, only left behind."""
    done = threading.Event()

    def run() -> None:
        try:
            probe(path)
        except OSError:
            pass  # an error is an answer: filesystem_findings reports it
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(timeout)


def filesystem_findings(path: str, timeout: float = STAT_TIMEOUT_S,
                        probe: Callable[[str], object] = os.statvfs) -> list[Finding]:
    if not answers_within(path, timeout, probe):
        return [Finding("checkpoint_fs", "drain", f"{path} did not answer a stat within {timeout:.0f} s")]
    try:
        info = os.statvfs(path)
    except OSError as exc:
        return [Finding("checkpoint_fs", "drain", f"{path}: {exc.strerror or exc}")]
    findings = []
    free, total = info.f_bavail * info.f_frsize, info.f_blocks * info.f_frsize
    if total and free < min(MIN_FREE_BYTES, MIN_FREE_FRACTION * total):
        findings.append(Finding("checkpoint_fs", "drain", f"{path}: only {free >> 20} MiB free"))
    if info.f_files and info.f_favail < MIN_FREE_FRACTION * info.f_files:
        findings.append(Finding("checkpoint_fs", "drain", f"{path}: only {info.f_favail} inodes free"))
    return findings


def memory_findings(meminfo: str, min_available_fraction: float = 0.05) -> list[Finding]:
    """/proc/meminfo: little memory available on an idle node means something leaked or hangs on."""
    values = {}
    for line in meminfo.splitlines():
        name, _, rest = line.partition(":")
        number = rest.split()
        if number and number[0].isdigit():
            values[name] = int(number[0])
    total, available = values.get("MemTotal"), values.get("MemAvailable")
    if total and available is not None and available < min_available_fraction * total:
        return [Finding("memory", "warn", f"{available >> 10} MiB of {total >> 10} MiB available")]
    return []
