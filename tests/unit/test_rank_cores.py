"""Each rank's cores: the step's CPUs split among the node's ranks (toolkit/train/cores.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from toolkit.train import cores


def hyperthreaded(threads_per_core: int, physical: int):
    """The kernel's numbering on x86: CPUs 0..n-1 are the cores' first threads, n.. their siblings."""
    def siblings(cpu: int) -> list[int]:
        core = cpu % physical
        return [core + physical * thread for thread in range(threads_per_core)]
    return siblings


@pytest.mark.parametrize(("text", "cpus"), [("0-3,8,10-11", [0, 1, 2, 3, 8, 10, 11]), ("5", [5]), ("", []),
                                            ("2,0-1\n", [0, 1, 2])])
def test_cpu_lists_read_and_write_as_the_kernel_and_slurm_spell_them(text, cpus):
    assert cores.parse_cpu_list(text) == cpus
    assert cores.parse_cpu_list(cores.format_cpu_list(cpus)) == cpus
    assert cores.format_cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def test_a_gpu_nodes_share_goes_in_whole_physical_cores_in_order():
    # An 8-GPU node's step holding 24 of 48 cores (hyperthreads 48-95 beside them) for 8 ranks.
    step = [*range(0, 24), *range(48, 72)]
    planned = cores.plan(step, 8, hyperthreaded(2, 48))
    assert planned[0] == [0, 1, 2, 48, 49, 50]  # three cores, each with its sibling
    assert planned[7] == [21, 22, 23, 69, 70, 71]
    assert sorted(cpu for rank in planned for cpu in rank) == step  # disjoint, and nothing left out


def test_a_remainder_stays_with_the_launcher_and_too_few_cpus_are_shared_and_said():
    planned = cores.plan([0, 1, 2, 3, 4], 2, hyperthreaded(1, 5))
    assert planned == [[0, 1], [2, 3]]  # core 4: the launcher and the watchdog
    assert cores.shortfall([0, 1, 2, 3, 4], 2) is None
    # Fewer physical cores than ranks: the hyperthreads are split.
    assert cores.plan([0, 1, 4, 5], 4, hyperthreaded(2, 4)) == [[0], [1], [4], [5]]
    # Fewer CPUs than ranks: every rank gets all, and the launcher says how many to ask for.
    assert cores.plan([3], 2, hyperthreaded(1, 4)) == [[3], [3]]
    message = cores.shortfall([3], 2)
    assert "1 CPU(s) (3) for 2 ranks" in message and "--cpus-per-task" in message and "at least 3" in message


def test_a_rank_keeps_to_its_planned_cores():
    available = sorted(os.sched_getaffinity(0))
    mine = available[-1:]
    script = ("import os; from toolkit.train import cores; "
              "print(cores.pin_to_planned_cores(), sorted(os.sched_getaffinity(0)))")
    env = dict(os.environ, **{cores.RANK_CORES_ENV: cores.format_cpu_list(mine)})
    printed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert printed.stdout == f"{mine} {mine}\n"
    env.pop(cores.RANK_CORES_ENV)
    printed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert printed.stdout == f"None {available}\n"  # nothing planned: nothing changed
