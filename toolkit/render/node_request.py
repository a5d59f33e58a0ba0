"""What a job asks of each node beside its GPUs: cores and memory, from the cluster profile.

On a cluster that confines jobs with cgroups (select/cons_tres with CR_Core_Memory and task/cgroup,
the common setup), a job gets what it asks for and no more: one task per node asking for nothing
gets one core and the partition's default memory, which its ranks, their data loading and the
watchdog would share. So a job asks for its share of the node (its GPUs' share of the node's cores
and memory), never less than a core per rank and one for the launcher; or the whole node where the
site gives GPU nodes whole (`exclusive_nodes`) or the job uses every GPU of its nodes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeRequest:
    exclusive: bool  # the whole node: --exclusive, --mem=0
    cpus: int | None  # --cpus-per-task of the one task per node (None with exclusive)
    memory_mb: int | None  # --mem (None: not known, Slurm's default)
    minimum_cpus: int  # a core per rank and one for the launcher and watchdog
    warnings: tuple[str, ...] = ()


def node_request(resolved) -> NodeRequest:
    profile, resources = resolved.profile, resolved.recipe.resources
    minimum = resolved.derived.workers_per_node + 1
    share = resources.gpus_per_node / profile.gpus_per_node if profile.gpus_per_node else 1.0
    if profile.exclusive_nodes or share >= 1:
        # Every GPU of the node: the whole node, as Slurm gives it (a site that keeps cores or
        # memory for itself, CoreSpecCount or MemSpecLimit, gives the rest), not sinfo's figures.
        return NodeRequest(True, None, None, minimum)
    warnings = []
    if profile.cpus_per_node is None:
        cpus = minimum
        warnings.append(f"profile {profile.name} does not give its nodes' cores (cpus_per_node): each node of the "
                        f"job asks for {minimum} (a core per rank and one for the launcher), not its share")
    else:
        cpus = max(int(profile.cpus_per_node * share), minimum)
        if cpus > profile.cpus_per_node:
            warnings.append(f"{resolved.derived.workers_per_node} ranks per node need {minimum} cores, and "
                            f"profile {profile.name}'s nodes have {profile.cpus_per_node}: Slurm will never start it")
    memory = int(profile.memory_per_node_mb * share) if profile.memory_per_node_mb else None
    if memory is None:
        warnings.append(f"profile {profile.name} does not give its nodes' memory (memory_per_node_mb): the job "
                        "gets the partition's default memory per node")
    return NodeRequest(False, cpus, memory, minimum, tuple(warnings))
