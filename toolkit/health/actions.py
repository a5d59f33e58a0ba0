"""What a finding costs the node, in one table, from the mildest action to the strongest:

    ignore   nothing: noise, or the application's own fault (it shows in the run's logs)
    warn     logged (syslog, ft-healthcheck's output): worth a look, not worth a node
    restart  the node is sound but its GPUs' state is not: jobs on it restart (a GPU reset comes
             with the next job); the health check does not drain for it
    drain    the node is taken out (Slurm drain, with the finding as the reason) until fixed

XID codes after NVIDIA's XID catalog (docs.nvidia.com/deploy/xid-errors) and the actions that
AWS HyperPod's and oci-hpc's health agents take for them.
"""

from __future__ import annotations

from dataclasses import dataclass

ORDER = ("ignore", "warn", "restart", "drain")

# XID -> (what it means, action)
XID = {
    13: ("graphics engine exception (usually the application's fault)", "warn"),
    31: ("GPU memory page fault (usually the application's fault)", "warn"),
    43: ("GPU stopped processing (the application's fault or a reset)", "warn"),
    45: ("preemptive cleanup after a fault", "ignore"),
    48: ("double-bit ECC error", "drain"),
    61: ("internal micro-controller breakpoint", "drain"),
    62: ("internal micro-controller halt", "drain"),
    63: ("ECC page retirement or row remapping recorded", "warn"),
    64: ("ECC page retirement or row remapping failed", "drain"),
    74: ("NVLink error", "drain"),
    79: ("GPU has fallen off the bus", "drain"),
    92: ("high single-bit ECC error rate", "warn"),
    94: ("contained ECC error: the application's context is lost", "restart"),
    95: ("uncontained ECC error", "drain"),
    119: ("GSP RPC timeout", "drain"),
    120: ("GSP error", "drain"),
    140: ("unrecovered ECC error", "drain"),
}
UNKNOWN_XID_ACTION = "warn"


@dataclass(frozen=True)
class Finding:
    check: str
    action: str
    detail: str

    def line(self) -> str:
        return f"{self.action}: {self.check}: {self.detail}"


def worst(findings: list[Finding]) -> str:
    return max((f.action for f in findings), key=ORDER.index, default="ignore")
