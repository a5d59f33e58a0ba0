"""Each rank's cores: the node's step holds the cores Slurm gave it (its cgroup and affinity), and
the launcher splits them among its ranks, so that ranks do not move across each other's cores and
caches, and each one's thread pools are as wide as its share (as DeepSpeed's --bind_cores_to_rank
does). Whole physical cores go to one rank (a hyperthread and its sibling stay together), in the
kernel's order, which on GPU nodes runs socket by socket as the GPUs' numbering does.

No torch here: the launcher plans, and each rank pins itself as it starts (a rank forked from the
warm template inherits the template's affinity, so the child sets its own).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

RANK_CORES_ENV = "FT_RANK_CORES"  # the rank's planned cores, "0,1,8,9"
SIBLINGS = "/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list"


def parse_cpu_list(text: str) -> list[int]:
    """`0-3,8,10-11` (the kernel's and Slurm's lists) -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return sorted(set(cpus))


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> `0-2,5`."""
    ranges: list[str] = []
    for cpu in sorted(cpus):
        if ranges and cpu == int(ranges[-1].rpartition("-")[2]) + 1:
            ranges[-1] = f"{ranges[-1].partition('-')[0]}-{cpu}"
        else:
            ranges.append(str(cpu))
    return ",".join(ranges)


def read_siblings(cpu: int) -> list[int]:
    try:
        return parse_cpu_list(Path(SIBLINGS.format(cpu=cpu)).read_text())
    except (OSError, ValueError):
        return [cpu]


def physical_cores(available: list[int], siblings: Callable[[int], list[int]] = read_siblings) -> list[list[int]]:
    """The available CPUs grouped by physical core, each group its available hyperthreads."""
    cores: dict[int, list[int]] = {}
    for cpu in sorted(available):
        first = min([sibling for sibling in siblings(cpu) if sibling in available] or [cpu])
        cores.setdefault(first, []).append(cpu)
    return [cores[first] for first in sorted(cores)]


def plan(available: list[int], ranks: int, siblings: Callable[[int], list[int]] = read_siblings) -> list[list[int]]:
    """Each local rank's CPUs: the physical cores split evenly, in order (a remainder stays with the
    launcher and the watchdog); with fewer cores than ranks, hyperthreads are split instead; with
    fewer CPUs than ranks, every rank gets them all (they share, and the launcher says so)."""
    if ranks <= 0:
        return []
    cores = physical_cores(available, siblings)
    if len(cores) < ranks:
        cores = [[cpu] for cpu in sorted(available)]
    if len(cores) < ranks:
        return [sorted(available)] * ranks
    each = len(cores) // ranks
    return [sorted(cpu for core in cores[rank * each:(rank + 1) * each] for cpu in core) for rank in range(ranks)]


def shortfall(available: list[int], ranks: int) -> str | None:
    """What to tell the user when the step holds fewer CPUs than it runs ranks."""
    if len(available) >= ranks:
        return None
    return (f"this node's step holds {len(available)} CPU(s) ({format_cpu_list(available)}) for {ranks} ranks: "
            f"they share them and each runs slower; ask for at least {ranks + 1} (--cpus-per-task: a core per "
            "rank and one for the launcher), as the rendered job script does from the cluster profile")


def pin_to_planned_cores() -> list[int] | None:
    """In a rank, as it starts: keep to the cores its launcher planned (RANK_CORES_ENV). Returns
    them, or None where nothing was planned."""
    planned = os.environ.get(RANK_CORES_ENV)
    if not planned:
        return None
    cores = parse_cpu_list(planned)
    try:
        os.sched_setaffinity(0, cores)
    except OSError:  # the step's cpuset changed under it (a cgroup update): keep what it has
        return sorted(os.sched_getaffinity(0))
    return cores
