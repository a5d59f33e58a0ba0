"""What the login node can check of a cluster profile: Slurm, the tiers' partitions and QOS, the
account, GPUs as GRES, the shared root, the recorded training environment."""

from __future__ import annotations

import difflib
import importlib.util
import os
import re
import sys
from pathlib import Path

from toolkit.base.build import build_id
from toolkit.base.shared_dirs import shared_root_path, unusable_root
from toolkit.cluster.discover import Discovery
from toolkit.cluster.prepare import ready_build
from toolkit.cluster.profile import ClusterProfile
from toolkit.doctor.findings import Finding, blocker, ok, warn

TRAINING_STACK = ("torch", "transformers", "peft", "deepspeed")


def closest(name: str, known: list[str]) -> str:
    match = difflib.get_close_matches(name, known, n=1)
    return match[0] if match else (known[0] if known else "NAME")


def check_slurm(found: Discovery) -> list[Finding]:
    if not found.slurm_version:
        return [blocker("slurm", f"Slurm's tools do not run on this host: {found.unread.get('slurm', 'no sinfo')}",
                        "load Slurm's client tools (`module load slurm`); on the local lab, `ft lab up`")]
    if "partitions" in found.unread:  # sinfo --version answers without the controller
        return [blocker("slurm", f"the Slurm controller does not answer: {found.unread['partitions'] or 'no reply'}",
                        "check `scontrol ping`; ask the cluster's admins; on the local lab, `ft lab up`")]
    return [ok("slurm", f"Slurm {found.slurm_version} answers"), check_backend(found.slurm_version)]


def check_backend(slurm_version: str) -> Finding:
    """How ft speaks to this Slurm, in one line: pyslurm where one built for this very release is
    installed (it builds against exactly one), else the command-line tools, and why."""
    from toolkit.slurm.client import pyslurm_unavailable_reason

    numbers = tuple(int(part) for part in re.findall(r"\d+", slurm_version)[:3])
    version = (numbers + (0, 0, 0))[:3] if numbers else None
    why = pyslurm_unavailable_reason(version)  # type: ignore[arg-type]
    if why is None:
        return ok("slurm_backend", f"ft asks Slurm {slurm_version} through pyslurm for job queries (built for it)")
    return ok("slurm_backend", f"ft asks Slurm through its command-line tools (--json where it has it): {why}")


def slurm_answers(found: Discovery) -> bool:
    return bool(found.slurm_version) and "partitions" not in found.unread


def check_tiers(profile: ClusterProfile, found: Discovery) -> list[Finding]:
    findings = []
    names = sorted(found.partitions)
    account = profile.default_account or found.default_account
    for tier, target in profile.tiers.items():
        partition = found.partitions.get(target.partition)
        if partition is None:
            findings.append(blocker(
                "partition", f"tier {tier}: partition {target.partition!r} does not exist "
                f"(this cluster's: {', '.join(names) or 'none readable'})",
                f"ft cluster set {profile.name} tiers.{tier}.partition={closest(target.partition, names)}"))
            continue
        if partition.state != "UP":
            findings.append(warn("partition", f"tier {tier}: partition {partition.name} is {partition.state}",
                                 "ask the cluster's admins, or use another partition for this tier"))
        refused = partition.admits(account, target.qos) or qos_refused(account, target.qos, found)
        if refused:
            findings.append(blocker("partition", f"tier {tier}: {refused}",
                                    f"ft cluster set {profile.name} default_account=... (or another partition)"))
        if target.qos and found.qos and target.qos not in found.qos:
            findings.append(blocker(
                "qos", f"tier {tier}: QOS {target.qos!r} does not exist (this cluster's: {', '.join(found.qos)})",
                f"ft cluster set {profile.name} tiers.{tier}.qos={closest(target.qos, found.qos)}"))
        if partition and not refused and partition.state == "UP":
            findings.append(ok("partition", f"tier {tier}: partition {partition.name}"
                                            + (f", QOS {target.qos}" if target.qos else "")))
    return findings


def qos_refused(account: str | None, qos: str | None, found: Discovery) -> str | None:
    """Why this user may not use the QOS under the account (their association's QOS list), or None."""
    allowed = found.account_qos.get(account or "", [])
    exists = not found.qos or qos in found.qos  # one that does not exist is named as such
    if qos and allowed and exists and qos not in allowed:
        return f"your association with account {account} may use QOS {', '.join(allowed)}, not {qos}"
    return None


def check_account(profile: ClusterProfile, found: Discovery) -> list[Finding]:
    if "accounts" in found.unread:
        return [warn("account", f"your Slurm accounts could not be read ({found.unread['accounts']}): "
                                "not checked", "")]
    if not found.accounts and found.enforces_associations:
        return [blocker("account", f"you ({found.user}) have no Slurm association: this cluster enforces them, "
                                   "so every job would be refused", "ask the cluster's admins to add you to an "
                                   "account (sacctmgr add user NAME account=ACCOUNT)")]
    if profile.default_account is None:
        if found.default_account or not found.accounts:
            return [ok("account", "jobs use your default Slurm account"
                                  + (f" ({found.default_account})" if found.default_account else ""))]
        return [warn("account", f"no account in the profile; yours: {', '.join(found.accounts)}",
                     f"ft cluster set {profile.name} default_account={found.accounts[0]}")]
    if profile.default_account not in found.accounts:
        yours = ", ".join(found.accounts) or "none"
        fix = (f"ft cluster set {profile.name} default_account={closest(profile.default_account, found.accounts)}"
               if found.accounts else "ask the cluster's admins for an account (sacctmgr add user)")
        return [blocker("account", f"you ({found.user}) have no association with Slurm account "
                                   f"{profile.default_account!r}: jobs would be refused (yours: {yours})", fix)]
    return [ok("account", f"account {profile.default_account}")]


def check_gpus(profile: ClusterProfile, found: Discovery) -> list[Finding]:
    if profile.gpus_per_node == 0:
        return [ok("gpus", "the profile asks for no GPUs")]
    standard = profile.standard_tier
    if standard.partition not in found.partitions:
        return []  # the partition check names it
    gpus, kind = found.gpus_in(standard.partition)
    if gpus == 0:
        return [blocker("gpus", f"no node of partition {standard.partition} has GPUs as GRES: jobs asking "
                                f"--gpus-per-node={profile.gpus_per_node} can never start",
                        "ask the cluster's admins to declare the GPUs (GresTypes=gpu, gres.conf), or pick the GPU "
                        f"partition: ft cluster set {profile.name} tiers.standard.partition=...")]
    if gpus < profile.gpus_per_node:
        return [blocker("gpus", f"partition {standard.partition}'s nodes have {gpus} GPUs, the profile asks "
                                f"{profile.gpus_per_node}", f"ft cluster set {profile.name} gpus_per_node={gpus}")]
    return [ok("gpus", f"{gpus} GPUs per node as GRES" + (f" ({kind})" if kind else ""))]


def check_node_size(profile: ClusterProfile, found: Discovery) -> list[Finding]:
    """What jobs ask of each node beside GPUs (toolkit/render/node_request.py) against the nodes:
    too few cores or too little memory starves the ranks where Slurm confines jobs (cgroups); more
    than a node has never starts."""
    if profile.exclusive_nodes:
        return [ok("node_size", "jobs take whole nodes (exclusive_nodes)")]
    cpus, memory = found.node_size(profile.standard_tier.partition)
    set_it = f"ft cluster set {profile.name}"
    if profile.cpus_per_node is None:
        said = f"; its nodes have {cpus} cores" if cpus else ""
        return [warn("node_size", "the profile gives no cores per node (cpus_per_node): each job asks a core per "
                                  f"rank and one for the launcher, not its share of the node{said}",
                     f"{set_it} cpus_per_node={cpus or '<cores>'}, or exclusive_nodes=true where nodes are "
                     "given whole")]
    if cpus and profile.cpus_per_node > cpus:
        return [blocker("node_size", f"the profile says {profile.cpus_per_node} cores per node; "
                                     f"partition {profile.standard_tier.partition}'s have {cpus}: jobs asking "
                                     "their share would wait for cores no node has", f"{set_it} cpus_per_node={cpus}")]
    if memory and profile.memory_per_node_mb and profile.memory_per_node_mb > memory:
        return [blocker("node_size", f"the profile says {profile.memory_per_node_mb} MB per node; "
                                     f"partition {profile.standard_tier.partition}'s have {memory}",
                        f"{set_it} memory_per_node_mb={memory}")]
    return [ok("node_size", f"jobs ask their share of {profile.cpus_per_node} cores"
                            + (f" and {profile.memory_per_node_mb} MB" if profile.memory_per_node_mb else "")
                            + " per node")]


def check_shared_root(profile: ClusterProfile) -> list[Finding]:
    if not profile.shared_root:
        return [blocker("shared_root", "the profile has no shared root: runs, checkpoints and the training "
                                       "environment need a filesystem every node shares",
                        f"ft cluster set {profile.name} shared_root=/path/on/the/shared/filesystem")]
    root = shared_root_path(profile.shared_root)
    fix = f"ft cluster set {profile.name} shared_root=/a/folder/you/may/write (or `mkdir -p {root}`)"
    problem = unusable_root(root)
    if problem:
        return [blocker("shared_root", f"{root} {problem}", fix)]
    return [ok("shared_root", f"{root} is writable")]


def missing_training_stack() -> list[str]:
    """The training packages this interpreter lacks (found without importing them: instant)."""
    return [name for name in TRAINING_STACK if importlib.util.find_spec(name) is None]


def check_environment(profile: ClusterProfile) -> list[Finding]:
    prepare = f"ft cluster prepare {profile.name}"
    if profile.in_container:
        return [ok("environment", f"container image {profile.container_image} ({profile.container_runtime}); "
                                  "the compute check below shows whether it holds ft")]
    if profile.environment == "venv":
        built = ready_build(profile.python)
        if built is None:
            return [blocker("environment", f"the training environment {profile.python} is missing or incomplete",
                            prepare)]
        if built != build_id():
            return [blocker("environment", f"the training environment holds ft {built}, this login node runs "
                                           f"{build_id()}: jobs would run other code than you tested",
                            prepare)]
        return [ok("environment", f"venv {Path(profile.python).parent.parent} (ft {built})")]
    python = profile.python or sys.executable
    if profile.python and not os.access(profile.python, os.X_OK):
        return [blocker("environment", f"the profile's python {profile.python} does not exist here", prepare)]
    missing = missing_training_stack() if not profile.python else []
    if missing:
        return [blocker("environment", f"no training environment: jobs would run {python}, which lacks "
                                       f"{', '.join(missing)} (a login-node install)", prepare)]
    return [ok("environment", f"jobs run {python}")]


def login_checks(profile: ClusterProfile, found: Discovery) -> list[Finding]:
    findings = check_slurm(found)
    if slurm_answers(found):
        findings += check_tiers(profile, found) + check_account(profile, found) + check_gpus(profile, found) \
            + check_node_size(profile, found)
    return findings + check_shared_root(profile) + check_environment(profile)
