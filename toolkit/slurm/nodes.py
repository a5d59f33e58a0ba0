"""The cluster's nodes, partitions and configuration as Slurm tells any user: sinfo, scontrol show.

Typed answers, the same on every Slurm version; each function takes the command runner (`run`), so
unit tests give recorded answers instead.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable
from dataclasses import dataclass

from toolkit.slurm import commands, shapes

# sinfo's long states of a node that runs jobs: in a reservation, or planned by the backfill
# scheduler for a pending job, it still serves.
SERVING = {"idle", "mixed", "allocated", "completing", "reserved", "planned"}


@dataclass(frozen=True)
class NodeState:
    name: str
    state: str  # sinfo's long state, lowercase: idle, mixed, drained, draining, down, ...
    reason: str

    @property
    def up(self) -> bool:
        return self.state.rstrip("*~#!%$@^-") in SERVING

    @property
    def drained(self) -> bool:
        return self.state.startswith("drain")

    @property
    def responding(self) -> bool:
        """slurmd answers the controller: not marked `*` (not responding) and not down or failed."""
        return not self.state.endswith("*") and not self.state.startswith(("down", "fail"))


NODE_STATE_FORMAT = "--format=%N|%T|%E"


def node_states(run: Callable = commands.run, nodes: str | None = None, timeout: float = 10.0) -> dict[str, NodeState]:
    """Every node's state and reason (only those of the host list `nodes`, where given)."""
    argv = ["sinfo", "--Node", "--noheader", *(["--nodes", nodes] if nodes else []), NODE_STATE_FORMAT]
    return parse_node_states(run(argv, timeout=timeout).stdout)


def parse_node_states(text: str) -> dict[str, NodeState]:
    """sinfo's NODE_STATE_FORMAT lines: a node appears once per partition."""
    found = {}
    for line in text.splitlines():
        parts = line.strip().split("|", 2)
        if len(parts) == 3 and parts[0]:
            found[parts[0]] = NodeState(parts[0], parts[1].lower(), "" if parts[2] == "none" else parts[2])
    return found


def partition_names(run: Callable = commands.run) -> set[str]:
    return set(run(["sinfo", "--noheader", "--format=%R"], timeout=10).stdout.split())


def config(run: Callable = commands.run, timeout: float = 20.0) -> dict[str, str]:
    """`scontrol show config`, by name ("(null)" where unset)."""
    return commands.parse_config(run(["scontrol", "show", "config"], timeout=timeout).stdout)


def version_text(run: Callable = commands.run) -> str:
    """What sinfo --version says ("slurm 24.11.5"): FtError where Slurm's tools are not here."""
    return run(["sinfo", "--version"]).stdout.strip()


@dataclass
class Partition:
    name: str
    default: bool = False
    state: str = "UP"
    max_nodes: int | None = None
    total_nodes: int = 0
    allow_accounts: str = "ALL"
    allow_qos: str = "ALL"
    preempt_mode: str = "OFF"  # REQUEUE, CANCEL, SUSPEND, GANG..., comma-separated

    def admits(self, account: str | None, qos: str | None) -> str | None:
        """Why this partition refuses the account or QOS, or None."""
        if account and self.allow_accounts not in ("ALL", "") and account not in self.allow_accounts.split(","):
            return f"partition {self.name} admits accounts {self.allow_accounts} only"
        if qos and self.allow_qos not in ("ALL", "") and qos not in self.allow_qos.split(","):
            return f"partition {self.name} admits QOS {self.allow_qos} only"
        return None


def key_values(line: str) -> dict[str, str]:
    """`scontrol show ... --oneliner` output: Key=Value pairs separated by spaces."""
    return dict(re.findall(r"(\w+)=(\S*)", line))


def partitions(run: Callable = commands.run) -> dict[str, Partition]:
    return parse_partitions(run(["scontrol", "show", "partition", "--oneliner"], timeout=20).stdout)


def parse_partitions(text: str) -> dict[str, Partition]:
    partitions = {}
    for line in text.splitlines():
        values = key_values(line)
        name = values.get("PartitionName")
        if not name:
            continue
        max_nodes = values.get("MaxNodes", "UNLIMITED")
        total = values.get("TotalNodes", "0")
        partitions[name] = Partition(
            name=name, default=values.get("Default") == "YES", state=values.get("State", "UP"),
            max_nodes=int(max_nodes) if max_nodes.isdigit() else None, total_nodes=int(total) if total.isdigit() else 0,
            allow_accounts=values.get("AllowAccounts", "ALL"), allow_qos=values.get("AllowQos", "ALL"),
            preempt_mode=values.get("PreemptMode", "OFF"))
    return partitions


@dataclass
class NodeGpus:
    node: str
    partitions: list[str]
    gpus: int
    gpu_type: str = ""
    cpus: int | None = None
    memory_mb: int | None = None


def node_gres(run: Callable = commands.run) -> dict[str, NodeGpus]:
    """Each node's GPUs (its GRES) and partitions."""
    return parse_node_gres(run(["sinfo", "--Node", "--noheader", "--format=%N|%P|%G|%c|%m"], timeout=20).stdout)


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


def parse_node_gres(text: str) -> dict[str, NodeGpus]:
    """`sinfo --Node --format=%N|%P|%G|%c|%m` lines (cores and memory: MB): a node appears once per
    partition."""
    nodes: dict[str, NodeGpus] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) not in (3, 5) or not parts[0]:
            continue
        name, partition, gres = parts[:3]
        cpus, memory = (int(part) if part.isdigit() else None for part in (parts[3:] or ["", ""]))
        gpus, kind = parse_gres(gres)
        node = nodes.setdefault(name, NodeGpus(name, [], gpus, kind, cpus, memory))
        node.partitions.append(partition.rstrip("*"))
    return nodes


SLURMD_PORT = 6818  # Slurm's default SlurmdPort


def node_addresses(nodes: list[str], run: Callable = commands.run, timeout: float = 10.0) -> dict[str, str]:
    """Each node's NodeAddr: where Slurm itself reaches its slurmd (a node's name need not resolve)."""
    result = run(["sinfo", "--noheader", "--Node", "--nodes", ",".join(nodes), "--format=%N|%o"],
                 timeout=timeout, check=False)
    found = {}
    for line in result.stdout.splitlines():
        name, _, address = line.strip().partition("|")
        if name in nodes and address and address not in ("(null)", "N/A"):
            found[name] = address
    return found


def slurmd_answers(address: str, port: int = SLURMD_PORT, timeout: float = 0.4, tries: int = 2) -> bool:
    """Whether the slurmd at this address takes a connection: a sign of life beside any job's own
    traffic. A live node's kernel answers a connect in milliseconds however busy the node. A refusal
    is an answer (the host is up, its slurmd is not); no answer in time is asked once more (a lost
    SYN is resent only after a second): a crashed host answers neither. The connection is closed at
    once (slurmd logs the empty connection)."""
    for _ in range(tries):
        try:
            with socket.create_connection((address, port), timeout=timeout):
                return True
        except ConnectionRefusedError:
            return False
        except OSError:
            continue
    return False


def drained(nodes: list[str], run: Callable = commands.run, timeout: float = 20.0) -> dict[str, str]:
    """The nodes among these that are drained or draining, with the reason."""
    result = run(["sinfo", "--noheader", "--Node", "--nodes", ",".join(nodes), NODE_STATE_FORMAT],
                 timeout=timeout, check=False)
    return {name: node.reason or node.state for name, node in parse_node_states(result.stdout).items()
            if name in nodes and "drain" in node.state}


def unresponsive(nodes: list[str], run: Callable = commands.run, timeout: float = 20.0) -> list[str]:
    """The nodes among these whose slurmd Slurm says does not answer (or that are down, or that
    Slurm does not list). SlurmCommandError where sinfo fails: no answer is no word that they answer."""
    states = node_states(run, ",".join(nodes), timeout)
    return sorted(name for name in nodes if name not in states or not states[name].responding)


@dataclass(frozen=True)
class NodeDetail:
    """A node as `sinfo --Node --json` describes it, the same on every Slurm version."""
    name: str
    state: str  # lowercase base state: idle, allocated, mixed, down, ...
    flags: tuple[str, ...]  # uppercase: DRAIN, NOT_RESPONDING, ...
    reason: str
    gres: str
    gres_used: str


def node_details(run: Callable = commands.run, timeout: float = 10.0) -> list[NodeDetail]:
    return parse_node_details(commands.run_json(["sinfo", "--Node", "--json"], timeout=timeout, runner=run))


def parse_node_details(answer: object) -> list[NodeDetail]:
    """`sinfo --Node --json`. 22.05: "nodes", one element a node ("state": "idle", "state_flags":
    ["DRAIN"], "reason", "gres", "gres_used"). 23.11 on: "sinfo", one element per node and partition
    ("nodes": {"nodes": [name]}, "node": {"state": ["IDLE", "DRAIN"]}, "reason": {"description"},
    "gres": {"total", "used"})."""
    if not isinstance(answer, dict):
        return []
    if isinstance(answer.get("sinfo"), list):
        return list({node.name: node for node in map(_from_sinfo_entry, answer["sinfo"]) if node}.values())
    listed = answer.get("nodes")
    found = []
    for node in listed if isinstance(listed, list) else []:
        if isinstance(node, dict) and shapes.text(node.get("name")):
            found.append(_detail(node["name"], node.get("state"), node.get("state_flags"), node.get("reason"),
                                 node.get("gres"), node.get("gres_used")))
    return found


def _from_sinfo_entry(entry: object) -> NodeDetail | None:
    names = shapes.dig(entry, "nodes", "nodes")
    if not isinstance(names, list) or len(names) != 1 or not shapes.text(names[0]):
        return None
    return _detail(names[0], shapes.dig(entry, "node", "state"), None, shapes.dig(entry, "reason", "description"),
                   shapes.dig(entry, "gres", "total"), shapes.dig(entry, "gres", "used"))


def _detail(name: str, state: object, more_flags: object, reason: object, gres: object, used: object) -> NodeDetail:
    words = [str(word) for word in (state if isinstance(state, list) else [state]) if word]
    flags = words[1:] + ([str(flag) for flag in more_flags if flag] if isinstance(more_flags, list) else [])
    return NodeDetail(name, (words[0] if words else "unknown").lower(), tuple(dict.fromkeys(f.upper() for f in flags)),
                      shapes.text(reason), shapes.text(gres), shapes.text(used))
