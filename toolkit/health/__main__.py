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
        return subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S).stdout
    except subprocess.TimeoutExpired:
        return f"{argv[0]} did not answer within {TOOL_TIMEOUT_S} s"


def sources(recorded: Path | None) -> Callable[[str, list[str]], str | None]:
    def read(name: str, argv: list[str]) -> str | None:
        if recorded is None:
            return tool_output(argv) if argv else Path("/proc/meminfo").read_text()
        path = recorded / name
        return path.read_text() if path.exists() else None
    return read


def run_checks(expected_gpus: int, paths: list[str], recorded: Path | None, xid_after: float = 0.0) -> list[Finding]:
    read = sources(recorded)
    findings: list[Finding] = []
    listing = read("nvidia-smi-L.txt", ["nvidia-smi", "-L"])
    if listing is not None:
        findings += gpu.count_findings(listing, expected_gpus)
        findings += gpu.query_findings(read("nvidia-smi-query.csv", ["nvidia-smi", f"--query-gpu={gpu.QUERY}",
                                                                      "--format=csv,noheader"]) or "")
        findings += gpu.nvlink_findings(read("nvidia-smi-nvlink.txt", ["nvidia-smi", "nvlink", "-e"]) or "")
        findings += gpu.xid_findings(read("dmesg.txt", ["dmesg"]) or "", after=xid_after)
    for path in paths:
        findings += host.filesystem_findings(path)
    meminfo = read("meminfo", [])
    if meminfo:
        findings += host.memory_findings(meminfo)
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
