"""A cluster profile proposed from what the login node discovered (`ft cluster add`): each field with
where its value came from, so the user sees what was found and what was assumed."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from toolkit.cluster.discover import Discovery
from toolkit.cluster.profile import ProfileError

TIERS = ("free", "standard", "premium")
# Partition names sites use for each tier, most likely first.
TIER_NAMES = {
    "free": ("free", "low", "preemptible", "spot", "scavenger", "dev", "debug"),
    "standard": ("standard", "normal", "compute", "train", "gpu", "batch", "main"),
    "premium": ("premium", "high", "urgent", "reserved", "priority"),
}


@dataclass
class Answers:
    """What the user gave on the command line (or at a prompt); None: discover or ask."""
    shared_root: str | None = None
    account: str | None = None
    tiers: dict[str, str] = field(default_factory=dict)  # tier -> PARTITION[:QOS]
    extends: str | None = None
    gpus_per_node: int | None = None
    cpu_workers_per_node: int | None = None
    fabric: str | None = None
    s3_prefix: str | None = None
    s3_endpoint: str | None = None
    price_per_gpu_hour: float | None = None


@dataclass
class Proposal:
    body: dict = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # field -> where its value came from
    missing: list[str] = field(default_factory=list)  # what must still be asked

    def set(self, name: str, value, source: str) -> None:
        self.body[name] = value
        self.sources[name] = source


def tier_target(spec: str) -> dict[str, str]:
    partition, _, qos = spec.partition(":")
    return {"partition": partition, **({"qos": qos} if qos else {})}


def guess_tiers(discovery: Discovery, given: dict[str, str]) -> dict[str, tuple[str, str]]:
    """tier -> (PARTITION[:QOS], why): the user's, else partitions named like a tier, else the
    default partition; a tier still without one shares the standard tier's."""
    names = {name.lower(): name for name in discovery.partitions if discovery.partitions[name].state == "UP"}
    chosen: dict[str, tuple[str, str]] = {tier: (spec, "--tier") for tier, spec in given.items()}
    for tier in TIERS:
        for candidate in TIER_NAMES[tier] if tier not in chosen else ():
            if candidate in names:
                chosen[tier] = (names[candidate], f"partition named {names[candidate]!r}")
                break
    default = discovery.default_partition
    if default and discovery.partitions[default].state != "UP":
        default = None
    if "standard" not in chosen and default:
        chosen["standard"] = (default, "the default partition")
    for tier in ("free", "premium"):
        if tier not in chosen and "standard" in chosen:
            chosen[tier] = (chosen["standard"][0], "no partition for this tier: the standard one")
    return chosen


def guess_fabric() -> str:
    """From the login node's RDMA devices, which the compute nodes usually share."""
    try:
        devices = os.listdir("/sys/class/infiniband")
    except OSError:
        return "none"
    if any("efa" in name for name in devices):
        return "efa"
    return "infiniband" if devices else "none"


def propose(discovery: Discovery, answers: Answers) -> Proposal:
    proposal = Proposal()
    if answers.extends:
        proposal.set("extends", answers.extends, "--extends")
    for tier, spec in answers.tiers.items():
        if tier not in TIERS:
            raise ProfileError(f"--tier {tier}={spec}: unknown tier", hint=f"tiers are {', '.join(TIERS)}")
    tiers = guess_tiers(discovery, answers.tiers)
    if "standard" in tiers:
        proposal.set("tiers", {tier: tier_target(spec) for tier, (spec, _) in tiers.items()},
                     "; ".join(f"{tier}: {why}" for tier, (_, why) in tiers.items()))
    elif not answers.extends:
        proposal.missing.append("tiers")
    standard = tier_target(tiers["standard"][0])["partition"] if "standard" in tiers else None

    if answers.gpus_per_node is not None:
        proposal.set("gpus_per_node", answers.gpus_per_node, "--gpus-per-node")
    elif standard:
        gpus, kind = discovery.gpus_in(standard)
        proposal.set("gpus_per_node", gpus, f"GRES of partition {standard}'s nodes" + (f" ({kind})" if kind else ""))
    if standard:  # the nodes' size: each job asks its share of their cores and memory
        cpus, memory = discovery.node_size(standard)
        if cpus:
            proposal.set("cpus_per_node", cpus, f"CPUs of partition {standard}'s GPU nodes (sinfo)")
        if memory:
            proposal.set("memory_per_node_mb", memory, f"memory of partition {standard}'s GPU nodes (sinfo)")
    if answers.cpu_workers_per_node is not None:
        proposal.set("cpu_workers_per_node", answers.cpu_workers_per_node, "--cpu-workers-per-node")
    elif proposal.body.get("gpus_per_node") == 0 and not answers.extends:
        proposal.set("cpu_workers_per_node", 1, "no GPU GRES: one CPU worker per node (gloo)")
    if standard and standard in discovery.partitions:
        partition = discovery.partitions[standard]
        nodes = partition.max_nodes or partition.total_nodes
        if nodes:
            proposal.set("max_nodes", nodes, f"partition {standard}'s " + ("MaxNodes" if partition.max_nodes
                                                                           else "node count"))

    if answers.account:
        proposal.set("default_account", answers.account, "--account")
    elif discovery.default_account:
        proposal.set("default_account", discovery.default_account, "your default Slurm account (sacctmgr)")
    elif len(discovery.accounts) == 1:
        proposal.set("default_account", discovery.accounts[0], "your only Slurm account (sacctmgr)")
    elif len(discovery.accounts) > 1:
        proposal.missing.append("default_account")

    if answers.shared_root:
        proposal.set("shared_root", answers.shared_root.rstrip("/") or "/", "--shared-root")
    elif not answers.extends:
        proposal.missing.append("shared_root")

    fabric = answers.fabric or (None if answers.extends else guess_fabric())
    if fabric:
        proposal.set("fabric", fabric, "--fabric" if answers.fabric else "the login node's RDMA devices")
    for name in ("s3_prefix", "s3_endpoint", "price_per_gpu_hour"):
        value = getattr(answers, name)
        if value is not None:
            proposal.set(name, value, "--" + name.replace("_", "-"))
    return proposal


def check_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", name):
        raise ProfileError(f"{name!r} is not a usable cluster name", hint="letters, digits, '.', '_' or '-' (1-63)")
    return name
