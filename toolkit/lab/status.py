"""What state the lab is in: its daemons, its bridge and namespaces, and Slurm's view of its nodes."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from toolkit.base.code_files import runs_old_code
from toolkit.lab.manifest import LabDaemon, LabManifest
from toolkit.lab.processes import daemon_pid, netns_exists
from toolkit.slurm.client import CliSlurmClient
from toolkit.slurm.commands import SlurmUnavailable
from toolkit.slurm.nodes import NodeDetail

# Node states in which a node serves jobs (drained nodes respond but take no new work).
SERVING_STATES = {"idle", "mixed", "allocated", "completing"}


@dataclass
class DaemonStatus:
    name: str
    pid: int | None
    node: str | None = None
    stale: bool = False  # ft's code it loaded has changed since (toolkit/base/code_files.py)

    @property
    def running(self) -> bool:
        return self.pid is not None


@dataclass
class NodeStatus:
    name: str
    address: str
    namespace: bool
    state: str = "unknown"
    flags: list[str] = field(default_factory=list)
    reason: str = ""
    gpus: str = ""

    @property
    def serving(self) -> bool:
        return self.state in SERVING_STATES and not (
            {"DRAIN", "NOT_RESPONDING", "DRAINING", "DRAINED"} & set(self.flags)
        )


@dataclass
class ObjectStoreStatus:
    url: str
    buckets: dict[str, str]
    answering: bool


@dataclass
class LabStatus:
    cluster: str
    bridge_up: bool
    daemons: list[DaemonStatus]
    nodes: list[NodeStatus]
    problems: list[str]
    object_store: ObjectStoreStatus | None = None
    prometheus: dict | None = None  # url, answering
    slurm: str = ""  # the release the lab runs (22.05: Debian's package; 24.11, 26.05: built)

    @property
    def up(self) -> bool:
        return self.bridge_up and any(d.running for d in self.daemons)

    @property
    def healthy(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {
            "cluster": self.cluster,
            "slurm": self.slurm,
            "up": self.up,
            "healthy": self.healthy,
            "bridge_up": self.bridge_up,
            "problems": self.problems,
            "daemons": [asdict(d) | {"running": d.running} for d in self.daemons],
            "nodes": [asdict(n) | {"serving": n.serving} for n in self.nodes],
            "object_store": asdict(self.object_store) if self.object_store else None,
            "prometheus": self.prometheus,
        }


def bridge_up(bridge: str) -> bool:
    try:
        with open(f"/sys/class/net/{bridge}/operstate") as handle:
            return handle.read().strip() in {"up", "unknown"}
    except OSError:
        return False


def answers(url: str, timeout: float = 3.0) -> bool:
    """An HTTP server answers (the S3 gateway's root says 403 to a request without credentials)."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(url, timeout=timeout)
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False
    return True


def slurm_nodes(manifest: LabManifest) -> dict[str, NodeDetail]:
    os.environ.setdefault("SLURM_CONF", manifest.slurm_conf)
    return {node.name: node for node in CliSlurmClient(timeout=10).nodes()}


def daemon_status(daemon: LabDaemon) -> DaemonStatus:
    pid = daemon_pid(daemon)
    stale = pid is not None and daemon.code is not None and runs_old_code(daemon.code)
    return DaemonStatus(daemon.name, pid, daemon.node, stale)


def collect(manifest: LabManifest) -> LabStatus:
    """Check the lab without changing it. Never touches a lab address unless the bridge is up."""
    problems: list[str] = []
    daemons = [daemon_status(d) for d in manifest.daemons]
    for daemon in daemons:
        if not daemon.running:
            problems.append(f"{daemon.name} is not running")
        elif daemon.stale:
            problems.append(f"{daemon.name} runs ft's code from before it last changed: `ft lab up` restarts it")
    has_bridge = bridge_up(manifest.bridge)
    if not has_bridge:
        problems.append(f"bridge {manifest.bridge} is down")
    nodes = [NodeStatus(n.name, n.address, netns_exists(n.netns)) for n in manifest.nodes]
    controller_running = any(d.running for d in daemons if d.name == "slurmctld")
    if has_bridge and controller_running:
        try:
            seen = slurm_nodes(manifest)
        except SlurmUnavailable as exc:
            problems.append(str(exc.message))
            seen = {}
        for node in nodes:
            info = seen.get(node.name)
            if info is None:
                continue
            node.state, node.flags, node.reason = info.state, list(info.flags), info.reason
            node.gpus = f"{info.gres_used} of {info.gres}".replace("gpu:", "")
    for node in nodes:
        if not node.namespace:
            problems.append(f"{node.name}: network namespace missing")
        elif controller_running and has_bridge and not node.serving:
            detail = f" ({node.reason})" if node.reason else ""
            problems.append(f"{node.name} is {node.state}{'+' + '+'.join(node.flags) if node.flags else ''}{detail}")
    store = None
    if manifest.object_store:
        answering = has_bridge and answers(manifest.object_store.url)
        store = ObjectStoreStatus(manifest.object_store.url, manifest.object_store.buckets, answering)
        if has_bridge and not answering:
            problems.append(f"the object store at {manifest.object_store.url} does not answer")
    prometheus = None
    if manifest.prometheus:
        prometheus = {"url": manifest.prometheus, "answering": answers(manifest.prometheus + "/-/ready")}
        if not prometheus["answering"]:
            problems.append(f"Prometheus at {manifest.prometheus} does not answer")
    return LabStatus(manifest.cluster, has_bridge, daemons, nodes, problems, store, prometheus, manifest.slurm)
