"""One doctor finding: a check's verdict where it ran, what is wrong, and the command that fixes it."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Finding:
    check: str  # slurm, partition, qos, account, gpus, shared_root, environment, ft_version, fabric, ...
    level: str  # ok | warn | blocker
    detail: str
    fix: str = ""
    where: str = "login"  # login, or the compute node it was seen on

    def to_dict(self) -> dict:
        return asdict(self)


def ok(check: str, detail: str, where: str = "login") -> Finding:
    return Finding(check, "ok", detail, "", where)


def warn(check: str, detail: str, fix: str = "", where: str = "login") -> Finding:
    return Finding(check, "warn", detail, fix, where)


def blocker(check: str, detail: str, fix: str, where: str = "login") -> Finding:
    return Finding(check, "blocker", detail, fix, where)


def merge_nodes(findings: list[Finding]) -> list[Finding]:
    """The same finding on several nodes, once, naming them all (a 32-node preflight says it once)."""
    merged: dict[tuple, list[str]] = {}
    for finding in findings:
        merged.setdefault((finding.check, finding.level, finding.detail, finding.fix), []).append(finding.where)
    return [Finding(check, level, detail, fix, ",".join(sorted(set(wheres))))
            for (check, level, detail, fix), wheres in merged.items()]
