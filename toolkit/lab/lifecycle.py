"""Bring the lab up, take it down, crash a node: what `ft lab` does, without the printing."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from toolkit.base.errors import FtError, UsageError
from toolkit.lab.manifest import BUILT_SLURMS, PACKAGE_SLURM, LabManifest, state_dir
from toolkit.lab.processes import cut_link, kill_netns, netns_exists
from toolkit.lab.provision import PlaybookFailed, PlaybookResult, ansible_dir, run_playbook
from toolkit.lab.status import LabStatus, NodeStatus, collect

DEFAULT_NODES = 4
MAX_NODES = 32  # each node is a slurmd in its own namespace; the lab subnet has room for more
SETTLE_S = 30.0  # the lab's SlurmdTimeout (10 s) and a ping or two: a node heard from again by then

# Files the lab playbook writes outside its state directory: a hand edit to any of them makes the
# next `ft lab up` run the playbook again instead of trusting the last run.
MANAGED_FILES = (
    "/etc/slurm/slurm.conf",
    "/etc/slurm/gres.conf",
    "/etc/slurm/cgroup.conf",
    "/etc/slurm/slurmdbd.conf",
    "/etc/ft/healthcheck.env",
    "/usr/local/sbin/ft-healthcheck",
    "/etc/hosts",
)


@dataclass
class UpOutcome:
    status: LabStatus
    playbook: PlaybookResult | None  # None when the lab was already up as configured

    @property
    def changed(self) -> int:
        return self.playbook.changed if self.playbook else 0


def require_root(command: str, why: str = "it creates network namespaces and starts daemons") -> None:
    """`command`: as the user typed it (ft lab up, ft chaos kill), so the hint is one to run."""
    if os.geteuid() != 0:
        raise FtError(f"`{command}` needs root: {why}", hint=f"run it as root: `sudo {command} ...`")


def node_count(requested: int | None, manifest: LabManifest | None) -> int:
    """The lab size: as asked, else the current lab's, else the default."""
    if requested is None:
        return len(manifest.nodes) if manifest else DEFAULT_NODES
    if not 1 <= requested <= MAX_NODES:
        raise UsageError(f"--nodes {requested} is out of range", hint=f"choose 1 to {MAX_NODES} lab nodes")
    return requested


def lab_vars(nodes: int | None, slices: int | None, manifest: LabManifest | None, slurm: str | None = None) -> dict:
    """What the lab playbook is given: the node count, the slices and the Slurm release, each as
    asked, else the current lab's, else the default (4 nodes, one slice, Debian's Slurm)."""
    count = node_count(nodes, manifest)
    release = slurm or (manifest.slurm if manifest else PACKAGE_SLURM)
    if release not in (PACKAGE_SLURM, *BUILT_SLURMS):
        raise UsageError(f"--slurm {release} is not a release the lab runs",
                         hint=f"choose {PACKAGE_SLURM} (Debian's package) or {', '.join(BUILT_SLURMS)} "
                              "(built once from Debian's source packages)")
    if slices is None:
        slices = len(manifest.slices) if manifest and manifest.slices else 1
    if not 1 <= slices <= count:
        raise UsageError(f"--slices {slices} does not fit {count} lab nodes",
                         hint="each slice needs a node: ask for fewer slices or more --nodes")
    return {"lab_node_count": count, "lab_slices": slices,
            "slurm_release": "" if release == PACKAGE_SLURM else release}


def fingerprint(extra_vars: dict) -> str:
    """Hash of what decides the lab: ft's Ansible tree, the node checks and alert rules it installs,
    the variables, and the files it manages."""
    digest = hashlib.sha256(json.dumps(extra_vars, sort_keys=True).encode())
    root = ansible_dir()
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    for path in sorted(Path(__file__).parents[1].joinpath("health").glob("*.py")):  # deployed by the role
        digest.update(path.read_bytes())
    for path in sorted((root.parent / "monitoring" / "alerts").glob("*.rules.yml")):  # copied by the role
        digest.update(path.read_bytes())
    for name in MANAGED_FILES:
        digest.update(name.encode())
        try:
            digest.update(Path(name).read_bytes())
        except OSError:
            digest.update(b"<missing>")
    return digest.hexdigest()


SHAPE = ("lab_node_count", "lab_slices")  # what a resize changes: the nodes, Slurm's configuration


def services_fingerprint(extra_vars: dict) -> str:
    """The fingerprint whatever the lab's shape (nodes, slices): what the lab's services (object
    store, munge, accounting, Prometheus) depend on. Equal to the last run's, a resize leaves them alone."""
    return fingerprint({key: value for key, value in extra_vars.items() if key not in SHAPE})


def applied_path() -> Path:
    return state_dir() / "applied.json"


def as_last_up(extra_vars: dict, manifest: LabManifest | None) -> bool:
    """The lab is configured exactly as the last successful `ft lab up` left it."""
    if manifest is None or len(manifest.nodes) != extra_vars["lab_node_count"] or \
            len(manifest.slices) != extra_vars["lab_slices"]:
        return False
    try:
        applied = json.loads(applied_path().read_text())
    except (OSError, ValueError):
        return False
    return applied.get("fingerprint") == fingerprint(extra_vars)


def resize_only(extra_vars: dict, manifest: LabManifest | None) -> bool:
    """The last `ft lab up` succeeded with everything as now but the node count."""
    if manifest is None:
        return False
    try:
        applied = json.loads(applied_path().read_text())
    except (OSError, ValueError):
        return False
    return any(applied.get(key, 1) != extra_vars[key] for key in SHAPE) and \
        applied.get("services") == services_fingerprint(extra_vars)


HEALTHCHECK_DRAIN = "ft-healthcheck:"  # the reason the node health check drains with, and resumes from


def nodes_to_heal(status: LabStatus) -> list[str]:
    """The nodes lab-heal.yml would bring back (their namespace, fake GPUs, slurmd) when nothing but
    nodes is wrong: a crash (`ft lab crash`), a GPU taken away (`ft chaos gpu-bad`). Empty when
    anything beyond the nodes is wrong (the bridge, the controller's daemons, a service): that is
    the whole playbook's."""
    down = {d.node for d in status.daemons if not d.running and d.node is not None}
    if not status.bridge_up or any(not d.running for d in status.daemons if d.node is None):
        return []
    unwell = [n.name for n in status.nodes if not n.namespace or not n.serving]  # a problem each (collect)
    if len(status.problems) > len(down) + len(unwell):
        return []
    return sorted(down | set(unwell))


def unheard(node: NodeStatus, after_heal: bool) -> bool:
    """A node that serves again by itself within seconds: one slurmctld has not heard from since a
    fault (its next ping settles it) or, once healed, one ft's health check drained (its next
    check, a few seconds away, resumes it)."""
    drained = {"DRAIN", "DRAINED", "DRAINING"} & set(node.flags)
    if node.namespace and "NOT_RESPONDING" in node.flags and not drained:
        return True
    return after_heal and bool(drained) and node.reason.startswith(HEALTHCHECK_DRAIN)


def only_nodes_unheard(status: LabStatus, after_heal: bool = False) -> bool:
    """Every daemon runs, and every problem is a node that will serve again by itself (`unheard`)."""
    unserving = [n for n in status.nodes if not n.serving]
    return bool(unserving) and len(status.problems) == len(unserving) and status.bridge_up and \
        all(d.running for d in status.daemons) and all(unheard(n, after_heal) for n in unserving)


def settled(manifest: LabManifest, status: LabStatus, after_heal: bool = False,
            timeout: float = SETTLE_S) -> LabStatus:
    deadline = time.monotonic() + timeout
    while only_nodes_unheard(status, after_heal) and time.monotonic() < deadline:
        time.sleep(1)
        status = collect(manifest)
    return status


def up(nodes: int | None = None, slices: int | None = None, reprovision: bool = False,
       on_task: Callable[[str], None] | None = None, only: Collection[str] | None = None,
       slurm: str | None = None) -> UpOutcome:
    """Bring the lab up as asked. `only`: a lab that is up as configured is checked and healed on
    these nodes alone (a slice's user heals no node another slice crashed on purpose)."""
    require_root("ft lab up")
    manifest = LabManifest.load()
    extra_vars = lab_vars(nodes, slices, manifest, slurm)
    if not reprovision and as_last_up(extra_vars, manifest):
        scope = manifest.only(only) if manifest and only is not None else manifest
        status, healed = settled(scope, collect(scope)), None  # the whole playbook would change nothing for these
        if not status.healthy and (wrong := nodes_to_heal(status)):  # still wrong after that: the whole playbook
            healed = run_playbook("lab-heal.yml", {**extra_vars, "lab_heal_nodes": wrong}, on_task=on_task)
            if healed.ok:
                status = settled(scope, collect(scope), after_heal=True)
        if status.healthy and (healed is None or healed.ok):
            return UpOutcome(status, healed)
    result = None
    if not reprovision and resize_only(extra_vars, manifest):
        # Only the node count changed: nodes, Slurm's configuration and daemons; the services that
        # know no node count are not visited (`services` in lab.yml). Anything then still wrong:
        # the whole playbook.
        resized = run_playbook("lab.yml", extra_vars, skip_tags=("services",), on_task=on_task)
        manifest = LabManifest.load()
        if resized.ok and manifest is not None and collect(manifest).healthy:
            result = resized
    if result is None:
        result = run_playbook("lab.yml", extra_vars, on_task=on_task)
    if not result.ok:
        raise PlaybookFailed(f"the lab playbook failed (full log: {result.log_path})\n{result.error}",
                             hint="fix the cause above and run `ft lab up` again; it resumes where it stopped")
    applied_path().write_text(json.dumps({"fingerprint": fingerprint(extra_vars),
                                          "services": services_fingerprint(extra_vars), **extra_vars}) + "\n")
    manifest = LabManifest.load()
    assert manifest is not None, "the lab playbook always writes lab.json"
    return UpOutcome(collect(manifest), result)


def down(purge: bool = False, on_task: Callable[[str], None] | None = None) -> PlaybookResult:
    require_root("ft lab down")
    manifest = LabManifest.load()
    applied_path().unlink(missing_ok=True)
    extra_vars = {**lab_vars(None, None, manifest), "lab_purge": purge}
    result = run_playbook("lab-down.yml", extra_vars, on_task=on_task)
    if not result.ok:
        raise PlaybookFailed(f"the lab teardown failed (full log: {result.log_path})\n{result.error}")
    return result


def crash(node_name: str) -> list[int]:
    """A power loss: the node's link cut first, so that nothing it held open is seen closing, then
    every process in its namespace killed. `ft lab up` heals it."""
    require_root("ft lab crash")
    manifest = LabManifest.load()
    if manifest is None:
        raise FtError("there is no lab on this machine", hint="run `ft lab up` first")
    netns = manifest.node(node_name).netns
    if not netns_exists(netns):
        raise FtError(f"lab node {node_name} has no namespace ({netns}): nothing to crash",
                      hint="`ft lab up` builds it")
    uncut = None
    try:
        cut_link(netns)
    except subprocess.CalledProcessError as exc:  # killed all the same: a crash asked for is a crash
        uncut = exc
    killed = kill_netns(netns)
    if uncut is not None:
        raise FtError(f"killed {len(killed)} processes of {node_name}, but its link could not be cut "
                      f"({uncut.stderr.decode(errors='replace').strip() or uncut}): its peers saw their "
                      "connections close, a kinder failure than a power loss",
                      hint="`ft lab up` heals the node; then crash it again")
    return killed
