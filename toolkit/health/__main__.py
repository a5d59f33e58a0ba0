"""python -m toolkit.health [--gpus N] [--path DIR ...] [--recorded DIR] [--xid-after SECONDS]

Prints one line per finding ("drain: gpu_xid: XID 79 on 0000:3b:00.0: GPU has fallen off the bus")
and exits 0 (nothing worse than a warning), 1 (drain the node) or 2 (restart its jobs). GPU checks
run where nvidia-smi exists; --recorded reads the tools' outputs from files instead (tests, and
replaying what a node printed): nvidia-smi-L.txt, nvidia-smi-query.csv, nvidia-smi-nvlink.txt,
dmesg.txt, meminfo.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from toolkit.health import gpu, host
from toolkit.health.actions import Finding, worst

EXIT = {"ignore": 0, "warn": 0, "restart": 2, "drain": 1}
TOOL_TIMEOUT_S = 15


def tool_output(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        # A kernel log holds whatever drivers printed (a device's name in any encoding): never a
        # reason for the checks to fail.
        return subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=TOOL_TIMEOUT_S).stdout
    except subprocess.TimeoutExpired:
        return f"{argv[0]} did not answer within {TOOL_TIMEOUT_S} s"


def sources(recorded: Path | None) -> Callable[[str, list[str]], str | None]:
    def read(name: str, argv: list[str]) -> str | None:
        """The tool's output (None where it is not there, or cannot be run or read)."""
        try:
            if recorded is None:
                return tool_output(argv) if argv else Path("/proc/meminfo").read_text(errors="replace")
            path = recorded / name
            return path.read_text(errors="replace") if path.exists() else None
        except OSError:
            return None
    return read


def guarded(name: str, check: Callable[[], list[Finding]]) -> list[Finding]:
    """One check's findings; a check that fails (a tool's output ft never saw) is a warning, and
    the other checks still run: a bug in one must not blind the others."""
    try:
        return check()
    except Exception as exc:  # noqa: BLE001 - reported as a finding, never fatal
        return [Finding(f"{name}_check_failed", "warn", f"the {name} check failed: {type(exc).__name__}: {exc}")]


def run_checks(expected_gpus: int, paths: list[str], recorded: Path | None, xid_after: float = 0.0) -> list[Finding]:
    read = sources(recorded)
    findings: list[Finding] = []
    listing = read("nvidia-smi-L.txt", ["nvidia-smi", "-L"])
    if listing is not None:
        findings += guarded("gpu_count", lambda: gpu.count_findings(listing, expected_gpus))
        findings += guarded("gpu_query", lambda: gpu.query_findings(read(
            "nvidia-smi-query.csv", ["nvidia-smi", f"--query-gpu={gpu.QUERY}", "--format=csv,noheader"]) or ""))
        findings += guarded("gpu_nvlink", lambda: gpu.nvlink_findings(
            read("nvidia-smi-nvlink.txt", ["nvidia-smi", "nvlink", "-e"]) or ""))
        findings += guarded("gpu_xid", lambda: gpu.xid_findings(read("dmesg.txt", ["dmesg"]) or "", after=xid_after))
    for path in paths:
        findings += guarded("filesystem", lambda path=path: host.filesystem_findings(path))
    meminfo = read("meminfo", [])
    if meminfo:
        findings += guarded("memory", lambda: host.memory_findings(meminfo))
    return findings


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit.health")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs this node should have")
    parser.add_argument("--path", action="append", default=[], help="a checkpoint filesystem to check")
    parser.add_argument("--recorded", type=Path, help="read the tools' outputs from this folder")
    parser.add_argument("--xid-after", type=float, default=0.0,
                        help="count only XIDs logged after this many seconds since boot (the last GPU reset)")
    args = parser.parse_args(argv)
    if not 0 <= args.xid_after < float("inf"):  # nan fails both
        parser.error(f"--xid-after {args.xid_after}: seconds since boot, a finite number >= 0")
    findings = run_checks(args.gpus, args.path, args.recorded, args.xid_after)
    for finding in findings:
        print(finding.line())
    return EXIT[worst(findings)]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
