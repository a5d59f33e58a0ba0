"""The lab's description, written by the lab playbook (role `lab`) to <state dir>/lab.json."""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path

from toolkit.base.errors import FtError
from toolkit.base.shared_dirs import login_name, open_regular


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
    code: str | None = None  # ft's own daemons: the record of ft's files it loads (toolkit/base/code_files.py)


@dataclass(frozen=True)
class LabObjectStore:
    """The lab's S3 (SeaweedFS on the bridge address). Each account has its own identity (as a site
    with per-user credentials would): its credentials are <credentials_dir>/<login>.json, readable by
    that account alone; root's is the lab's admin."""

    url: str
    buckets: dict[str, str]
    credentials_dir: str

    @property
    def env(self) -> dict[str, str]:
        """What a shell (or a test) exports to use it as the calling account; jobs inherit it from
        sbatch. FtError where this account has no identity in the lab."""
        login = login_name(os.getuid()) or str(os.getuid())
        path = Path(self.credentials_dir) / f"{login}.json"
        try:
            with open_regular(path) as handle:
                credentials = json.loads(handle.read(4096))
            access_key, secret_key = str(credentials["access_key"]), str(credentials["secret_key"])
        except FileNotFoundError:
            raise FtError(f"the lab's object store has no identity for {login}",
                          hint="the lab's accounts (ft lab status) and root have one; run ft as one of them, or "
                               "`ft lab up` again if this is one") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise FtError(f"cannot read your lab object-store credentials {path}: {exc}",
                          hint="`ft lab up` writes them again") from None
        return {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": access_key,
                "AWS_SECRET_ACCESS_KEY": secret_key, "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass(frozen=True)
class LabSlice:
    """A share of the lab's nodes with partitions of its own (`ft lab up --slices K`): people, or the
    test suite's streams, use one lab without taking each other's nodes."""

    index: int
    nodes: tuple[str, ...]
    tiers: dict[str, str]  # tier -> its partition in this slice
    profile: str  # the ft profile (a site profile file) whose tiers are these partitions


# The Slurm releases the lab runs: Debian 12's package, and those ft builds from Debian's source
# packages (ansible/roles/slurm: slurm_build_sources).
PACKAGE_SLURM = "22.05"
BUILT_SLURMS = ("24.11", "26.05")


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
    slices: tuple[LabSlice, ...] = ()
    slurm: str = PACKAGE_SLURM  # the Slurm release it runs: Debian's package, or one built (`--slurm`)

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
                LabDaemon(d["name"], d["exe"], d["pidfile"], d.get("netns"), d.get("node"), d.get("code"))
                for d in raw["daemons"]
            ),
            users=tuple(raw.get("users", ())),
            object_store=LabObjectStore(store["url"], dict(store["buckets"]), store.get("credentials_dir", ""))
            if (store := raw.get("object_store")) else None,
            prometheus=raw.get("prometheus"),
            slices=tuple(LabSlice(int(s["index"]), tuple(s["nodes"]), dict(s["tiers"]), s["profile"])
                         for s in raw.get("slices", ())),
            slurm=raw.get("slurm") or PACKAGE_SLURM,
        )

    @property
    def tiers(self) -> dict[str, str]:
        """Each tier's partition (in the first slice, the only one a slice's view holds)."""
        return dict(self.slices[0].tiers) if self.slices else {name: name for name in self.partitions}

    def slice(self, index: int) -> LabManifest:
        """The lab as one of its slices sees it: that slice's nodes, their daemons and partitions
        (the controller's daemons are everyone's)."""
        chosen = next((s for s in self.slices if s.index == index), None)
        if chosen is None:
            from toolkit.base.errors import UsageError

            raise UsageError(f"the lab has no slice {index}",
                             hint=f"bring it up in slices: `ft lab up --nodes N --slices {index}`")
        view = self.only(chosen.nodes)
        return replace(view, partitions=tuple(chosen.tiers.values()), slices=(chosen,))

    def only(self, names: Collection[str]) -> LabManifest:
        """The lab with only these nodes (and their daemons) in view."""
        return replace(self, nodes=tuple(n for n in self.nodes if n.name in names),
                       daemons=tuple(d for d in self.daemons if d.node is None or d.node in names))

    def node(self, name: str) -> LabNode:
        for node in self.nodes:
            if node.name == name:
                return node
        from toolkit.base.errors import UsageError

        known = ", ".join(n.name for n in self.nodes)
        raise UsageError(f"the lab has no node {name!r}", hint=f"lab nodes: {known}")
