"""What a login node tells about its cluster without any rights beyond a user's: Slurm's version,
partitions and their limits, the nodes' GPU GRES, QOS, this user's accounts, and filesystems that
look shared. `ft cluster add` proposes a profile from it; `ft doctor` checks a profile against it.

Every reader is read-only and tolerant: a cluster without accounting (no sacctmgr answer) still
gives partitions and GRES, and says what it could not read."""

from __future__ import annotations

import getpass
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from toolkit.slurm import commands

# Filesystems a cluster shares between its nodes (Lustre, NFS, GPFS/Spectrum Scale, BeeGFS, WEKA,
# CephFS, Panasas, VAST over NFS).
SHARED_FS_TYPES = {"lustre", "nfs", "nfs4", "gpfs", "beegfs", "wekafs", "ceph", "cephfs", "panfs",
                   "fuse.beegfs", "fuse.weka", "fuse.ceph", "fuse.lustre"}
# Variables many sites set to their scratch or project space.
SHARED_ENV_HINTS = ("SCRATCH", "WORK", "PROJECT", "SHARED")

Runner = Callable[[list[str]], "commands.CommandResult"]


def run_quietly(argv: list[str]) -> commands.CommandResult:
    try:
        return commands.run(argv, check=False)
    except commands.SlurmUnavailable as exc:
        return commands.CommandResult(tuple(argv), 127, "", exc.message)


@dataclass
class Partition:
    name: str
    default: bool = False
    state: str = "UP"
    max_nodes: int | None = None
    total_nodes: int = 0
    allow_accounts: str = "ALL"
    allow_qos: str = "ALL"

    def admits(self, account: str | None, qos: str | None) -> str | None:
        """Why this partition refuses the account or QOS, or None."""
        if account and self.allow_accounts not in ("ALL", "") and account not in self.allow_accounts.split(","):
            return f"partition {self.name} admits accounts {self.allow_accounts} only"
        if qos and self.allow_qos not in ("ALL", "") and qos not in self.allow_qos.split(","):
            return f"partition {self.name} admits QOS {self.allow_qos} only"
        return None


@dataclass
class NodeGpus:
    node: str
    partitions: list[str]
    gpus: int
    gpu_type: str = ""


@dataclass
class Discovery:
    user: str
    slurm_version: str = ""
    partitions: dict[str, Partition] = field(default_factory=dict)
    nodes: dict[str, NodeGpus] = field(default_factory=dict)
    qos: list[str] = field(default_factory=list)
    accounts: list[str] = field(default_factory=list)  # this user's associations
    account_qos: dict[str, list[str]] = field(default_factory=dict)  # account -> the QOS this user may use there
    default_account: str | None = None
    enforces_associations: bool = False  # AccountingStorageEnforce: a job needs an association
    shared_candidates: list[str] = field(default_factory=list)
    unread: dict[str, str] = field(default_factory=dict)  # what could not be read, and why

    @property
    def default_partition(self) -> str | None:
        defaults = [p.name for p in self.partitions.values() if p.default]
        return defaults[0] if defaults else next(iter(self.partitions), None)

    def gpus_in(self, partition: str) -> tuple[int, str]:
        """The most GPUs a node of the partition has as GRES, and their type ('' when untyped)."""
        found = [n for n in self.nodes.values() if partition in n.partitions]
        if not found:
            return 0, ""
        best = max(found, key=lambda n: n.gpus)
        return best.gpus, best.gpu_type

    def to_dict(self) -> dict:
        return asdict(self)


def parse_key_values(line: str) -> dict[str, str]:
    """`scontrol show ... --oneliner` output: Key=Value pairs separated by spaces."""
    return dict(re.findall(r"(\w+)=(\S*)", line))


def parse_partitions(text: str) -> dict[str, Partition]:
    partitions = {}
    for line in text.splitlines():
        values = parse_key_values(line)
        name = values.get("PartitionName")
        if not name:
            continue
        max_nodes = values.get("MaxNodes", "UNLIMITED")
        total = values.get("TotalNodes", "0")
        partitions[name] = Partition(
            name=name, default=values.get("Default") == "YES", state=values.get("State", "UP"),
            max_nodes=int(max_nodes) if max_nodes.isdigit() else None, total_nodes=int(total) if total.isdigit() else 0,
            allow_accounts=values.get("AllowAccounts", "ALL"), allow_qos=values.get("AllowQos", "ALL"))
    return partitions


def parse_gres(gres: str) -> tuple[int, str]:
    """`gpu:h100:8(S:0-1),nic:2` -> (8, 'h100'); `gpu:4` -> (4, ''); no GPU -> (0, '')."""
    total, kind = 0, ""
    for item in re.split(r",(?![^()]*\))", gres):
        parts = re.sub(r"\(.*\)", "", item).split(":")
        if parts[0] != "gpu" or len(parts) < 2:
            continue
        count = parts[-1]
        if count.isdigit():
            total += int(count)
            kind = parts[1] if len(parts) == 3 else kind
    return total, kind


def parse_nodes(text: str) -> dict[str, NodeGpus]:
    """`sinfo --Node --noheader --format=%N|%P|%G`: a node appears once per partition."""
    nodes: dict[str, NodeGpus] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 3 or not parts[0]:
            continue
        name, partition, gres = parts
        gpus, kind = parse_gres(gres)
        node = nodes.setdefault(name, NodeGpus(name, [], gpus, kind))
        node.partitions.append(partition.rstrip("*"))
    return nodes


def shared_filesystems(mounts: str, environ: dict[str, str] | None = None) -> list[str]:
    """Mount points of shared filesystem types (/proc/mounts), then the site's scratch variables."""
    environ = os.environ if environ is None else environ
    found = []
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[2] in SHARED_FS_TYPES and parts[1] not in found:
            found.append(parts[1].replace("\\040", " "))
    for name in SHARED_ENV_HINTS:
        value = environ.get(name, "")
        if value.startswith("/") and value not in found:
            found.append(value)
    return found


def discover(run: Runner = run_quietly, user: str | None = None) -> Discovery:
    user = user or getpass.getuser()
    found = Discovery(user=user)
    version = run(["sinfo", "--version"])
    if version.returncode != 0:
        found.unread["slurm"] = version.stderr.strip() or "sinfo failed"
        return found
    numbers = re.search(r"\d+\.\d+(\.\d+)?", version.stdout)
    found.slurm_version = numbers.group() if numbers else version.stdout.strip()
    partitions = run(["scontrol", "show", "partition", "--oneliner"])
    found.partitions = parse_partitions(partitions.stdout)
    if partitions.returncode != 0:
        found.unread["partitions"] = partitions.stderr.strip()
    nodes = run(["sinfo", "--Node", "--noheader", "--format=%N|%P|%G"])
    found.nodes = parse_nodes(nodes.stdout)
    qos = run(["sacctmgr", "--noheader", "--parsable2", "show", "qos", "format=Name"])
    if qos.returncode == 0:
        found.qos = [line.strip() for line in qos.stdout.splitlines() if line.strip()]
    else:
        found.unread["qos"] = qos.stderr.strip() or "sacctmgr failed (accounting off?)"
    enforce = commands.parse_config(run(["scontrol", "show", "config"]).stdout).get("AccountingStorageEnforce", "")
    found.enforces_associations = bool(re.search(r"assoc|limits|qos|safe", enforce))
    associations = run(["sacctmgr", "--noheader", "--parsable2", "show", "associations", f"user={user}",
                        "format=Account,QOS"])
    if associations.returncode == 0:
        for line in associations.stdout.splitlines():
            account, _, qos = line.strip().partition("|")
            if account:
                found.account_qos.setdefault(account, [])
                found.account_qos[account] += [q for q in qos.split(",") if q and q not in found.account_qos[account]]
        found.accounts = sorted(found.account_qos)
        default = run(["sacctmgr", "--noheader", "--parsable2", "show", "user", user, "format=DefaultAccount"])
        found.default_account = default.stdout.strip().splitlines()[0] if default.stdout.strip() else None
    else:
        found.unread["accounts"] = associations.stderr.strip() or "sacctmgr failed (accounting off?)"
    try:
        mounts = Path("/proc/mounts").read_text()
    except OSError:
        mounts = ""
    found.shared_candidates = shared_filesystems(mounts)
    return found
