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

from toolkit.base.errors import FtError
from toolkit.slurm import accounting as slurm_accounting
from toolkit.slurm import commands
from toolkit.slurm import nodes as slurm_nodes
from toolkit.slurm.nodes import NodeGpus, Partition

# Filesystems a cluster shares between its nodes (Lustre, NFS, GPFS/Spectrum Scale, BeeGFS, WEKA,
# CephFS, Panasas, VAST over NFS).
SHARED_FS_TYPES = {"lustre", "nfs", "nfs4", "gpfs", "beegfs", "wekafs", "ceph", "cephfs", "panfs",
                   "fuse.beegfs", "fuse.weka", "fuse.ceph", "fuse.lustre"}
# Variables many sites set to their scratch or project space.
SHARED_ENV_HINTS = ("SCRATCH", "WORK", "PROJECT", "SHARED")



def read(ask: Callable, empty, why_empty: str = "") -> tuple:
    """What Slurm answered, and "" ; or `empty` and why it did not answer."""
    try:
        return ask(), ""
    except FtError as error:
        return empty, error.message.strip() or why_empty


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

    def node_size(self, partition: str) -> tuple[int | None, int | None]:
        """The fewest cores and least memory (MB) of the partition's GPU nodes (None: not known)."""
        found = [n for n in self.nodes.values() if partition in n.partitions and n.gpus]
        cpus = [n.cpus for n in found if n.cpus]
        memory = [n.memory_mb for n in found if n.memory_mb]
        return min(cpus, default=None), min(memory, default=None)

    def to_dict(self) -> dict:
        return asdict(self)


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


def discover(run: Callable = commands.run, user: str | None = None) -> Discovery:
    user = user or getpass.getuser()
    found = Discovery(user=user)
    try:
        version = slurm_nodes.version_text(run)
    except FtError as error:
        found.unread["slurm"] = error.message or "sinfo failed"
        return found
    numbers = re.search(r"\d+\.\d+(\.\d+)?", version)
    found.slurm_version = numbers.group() if numbers else version
    found.partitions, found.unread["partitions"] = read(lambda: slurm_nodes.partitions(run), {})
    found.nodes, _ = read(lambda: slurm_nodes.node_gres(run), {})
    found.qos, found.unread["qos"] = read(lambda: slurm_accounting.qos_names(run), [],
                                          "sacctmgr failed (accounting off?)")
    enforce = read(lambda: slurm_nodes.config(run), {})[0].get("AccountingStorageEnforce", "")
    found.enforces_associations = bool(re.search(r"assoc|limits|qos|safe", enforce))
    found.account_qos, found.unread["accounts"] = read(lambda: slurm_accounting.user_associations(user, run), {},
                                                       "sacctmgr failed (accounting off?)")
    if not found.unread["accounts"]:
        found.accounts = sorted(found.account_qos)
        found.default_account = read(lambda: slurm_accounting.default_account(user, run), None)[0]
    found.unread = {what: why for what, why in found.unread.items() if why}
    try:
        mounts = Path("/proc/mounts").read_text()
    except OSError:
        mounts = ""
    found.shared_candidates = shared_filesystems(mounts)
    return found
