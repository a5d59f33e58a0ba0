"""GPU checks from the tools every GPU node has: nvidia-smi's queries and the kernel log's XID
lines. Each parser takes the tool's text, so that tests feed recorded outputs of real tools."""

from __future__ import annotations

import re

from toolkit.health.actions import UNKNOWN_XID_ACTION, XID, Finding

QUERY = ("index,pci.bus_id,ecc.errors.uncorrected.volatile.total,retired_pages.pending,"
         "remapped_rows.pending,remapped_rows.failure")
XID_LINE = re.compile(r"NVRM: Xid \(PCI:([0-9a-fA-F:.]+)\): (\d{1,6}),(.*)")
KERNEL_STAMP = re.compile(r"\[\s*(\d+(?:\.\d+)?)\]")  # dmesg's "[ 5501.10]": seconds since boot


def count_findings(listing: str, expected: int) -> list[Finding]:
    """`nvidia-smi -L`: one "GPU n: ..." line per GPU the driver sees."""
    found = sum(1 for line in listing.splitlines() if line.startswith("GPU "))
    if found < expected:
        return [Finding("gpu_count", "drain", f"{found} of {expected} GPUs visible to the driver")]
    return []


def query_findings(csv: str) -> list[Finding]:
    """`nvidia-smi --query-gpu=<QUERY> --format=csv,noheader`: per GPU, uncorrectable ECC errors
    since the last reset, retired pages or remapped rows waiting for a reset, a failed remap."""
    findings = []
    for line in csv.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 6:
            continue
        index, bus, uncorrected, retired_pending, remap_pending, remap_failure = fields
        where = f"GPU {index} ({bus})"
        if uncorrected.isdigit() and int(uncorrected) > 0:
            findings.append(Finding("gpu_ecc", "drain", f"{where}: {uncorrected} uncorrectable ECC errors"))
        if retired_pending == "Yes" or remap_pending == "Yes":
            findings.append(Finding("gpu_pending_reset", "drain",
                                    f"{where}: retired pages or remapped rows wait for a GPU reset"))
        if remap_failure == "Yes":
            findings.append(Finding("gpu_remap_failed", "drain", f"{where}: a row remap failed: replace the GPU"))
    return findings


def xid_findings(kernel_log: str, after: float = 0.0) -> list[Finding]:
    """XID lines of the kernel log (dmesg / journalctl -k), each once per GPU and code. A "restart"
    XID stamped no later than `after` (seconds since boot, dmesg's stamp) is left out: the kernel
    keeps it until the next boot, and the node's last GPU reset, at `after`, dealt with it. Any
    worse XID counts whenever it came: a reset clears a lost context, not a broken GPU."""
    findings, seen = [], set()
    for line in kernel_log.splitlines():
        match = XID_LINE.search(line)
        if not match:
            continue
        bus, code = match[1], int(match[2])
        meaning, action = XID.get(code, ("not in ft's table", UNKNOWN_XID_ACTION))
        stamp = KERNEL_STAMP.match(line)
        if action == "restart" and stamp and float(stamp[1]) <= after:
            continue
        if (bus, code) in seen:
            continue
        seen.add((bus, code))
        findings.append(Finding("gpu_xid", action, f"XID {code} on {bus}: {meaning}"))
    return findings


def nvlink_findings(errors: str) -> list[Finding]:
    """`nvidia-smi nvlink -e`: a link with CRC errors that cannot be replayed away, or recovery
    errors, is a failing link."""
    findings, gpu = [], "?"
    for line in errors.splitlines():
        header = re.match(r"GPU (\d+):", line)
        if header:
            gpu = header[1]
            continue
        counter = re.match(r"\s*Link (\d+): (Recovery|CRC Data|CRC Flit|Replay) Errors?: (\d+)", line)
        if counter and counter[2] == "Recovery" and int(counter[3]) > 0:
            findings.append(Finding("gpu_nvlink", "drain",
                                    f"GPU {gpu} link {counter[1]}: {counter[3]} recovery errors"))
    return findings
