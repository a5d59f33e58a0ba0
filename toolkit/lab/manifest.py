"""The lab's description, written by the lab playbook (role `lab`) to <state dir>/lab.json."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


def state_dir() -> Path:
    return Path(os.environ.get("FT_LAB_STATE_DIR", "/var/lib/ft-lab"))


@dataclass(frozen=True)
class LabNode:
    name: str
    address: str
    netns: str
    gpus: int


@dataclass(frozen=True)
class LabDaemon:
    name: str
    exe: str
    pidfile: str
    netns: str | None = None
    node: str | None = None


@dataclass(frozen=True)
class LabObjectStore:
    """The lab's S3 (SeaweedFS on the bridge address) and its lab-only credentials."""

    url: str
    buckets: dict[str, str]
    access_key: str
    secret_key: str

    @property
    def env(self) -> dict[str, str]:
        """What a shell (or a test) exports to use it; jobs inherit it from sbatch."""
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass(frozen=True)
class LabManifest:
    cluster: str
    subnet: str
    bridge: str
    controller_name: str
    controller_address: str
    nodes: tuple[LabNode, ...]
    gpus_per_node: int
    partitions: tuple[str, ...]
    slurm_conf: str
    shared_dir: str
    log_dir: str
    daemons: tuple[LabDaemon, ...]
    users: tuple[str, ...] = ()  # unprivileged accounts, for trying ft without root
    object_store: LabObjectStore | None = None
    prometheus: str | None = None  # its URL: every run's metrics (ansible/roles/prometheus)

    @classmethod
    def load(cls, path: Path | None = None) -> LabManifest | None:
        """The lab's manifest, or None when no lab was ever brought up here."""
        path = path or state_dir() / "lab.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        return cls(
            cluster=raw["cluster"],
            subnet=raw["subnet"],
            bridge=raw["bridge"],
            controller_name=raw["controller"]["name"],
            controller_address=raw["controller"]["address"],
            nodes=tuple(LabNode(n["name"], n["address"], n["netns"], int(n["gpus"])) for n in raw["nodes"]),
            gpus_per_node=int(raw["gpus_per_node"]),
            partitions=tuple(raw["partitions"]),
            slurm_conf=raw["slurm_conf"],
            shared_dir=raw["shared_dir"],
            log_dir=raw["log_dir"],
            daemons=tuple(
                LabDaemon(d["name"], d["exe"], d["pidfile"], d.get("netns"), d.get("node")) for d in raw["daemons"]
            ),
            users=tuple(raw.get("users", ())),
            object_store=LabObjectStore(store["url"], dict(store["buckets"]), store["access_key"],
                                        store["secret_key"]) if (store := raw.get("object_store")) else None,
            prometheus=raw.get("prometheus"),
        )

    def node(self, name: str) -> LabNode:
        for node in self.nodes:
            if node.name == name:
                return node
        from toolkit.errors import UsageError

        known = ", ".join(n.name for n in self.nodes)
        raise UsageError(f"the lab has no node {name!r}", hint=f"lab nodes: {known}")
