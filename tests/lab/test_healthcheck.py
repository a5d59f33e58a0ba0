"""The HealthCheckProgram hook: a node that loses a GPU is drained, and resumed once it is back."""

from __future__ import annotations

import os
import stat

import pytest

from tests.support.slurm import wait_for
from toolkit.slurm import commands, nodes

pytestmark = pytest.mark.slurm_matrix  # drains and resumes through Slurm: run on every release


def node_info(name: str) -> nodes.NodeDetail:
    return next(node for node in nodes.node_details() if node.name == name)


def test_lost_gpu_drains_the_node_and_its_return_resumes_it(lab):
    node = lab.nodes[-1]
    device = f"/var/lib/ft-lab/dev/{node.name}/nvidia{lab.gpus_per_node - 1}"
    info = os.stat(device)
    assert stat.S_ISCHR(info.st_mode)
    os.unlink(device)
    try:
        drained = wait_for(f"{node.name} to be drained by ft-healthcheck",
                           lambda: (lambda n: n if "DRAIN" in n.flags else None)(node_info(node.name)),
                           timeout=60)
        assert drained.reason.startswith("ft-healthcheck: 10-gpu-devices: found 3 of 4")
    finally:
        os.mknod(device, stat.S_IFCHR | 0o666, info.st_rdev)
        # As it was: a device newer than its slurmd makes `ft lab up` restart the node (gpu_devices).
        os.utime(device, ns=(info.st_atime_ns, info.st_mtime_ns))
    wait_for(f"{node.name} to be resumed by ft-healthcheck",
             lambda: "DRAIN" not in node_info(node.name).flags, timeout=60)


def test_a_drain_by_someone_else_is_left_alone(lab):
    node = lab.nodes[-1]
    commands.run(["scontrol", "update", f"nodename={node.name}", "state=drain", "reason=admin: maintenance"])
    try:
        # Two health check rounds (HealthCheckInterval=5) pass with every hook green.
        import time

        time.sleep(12)
        info = node_info(node.name)
        assert "DRAIN" in info.flags
        assert info.reason == "admin: maintenance"
    finally:
        commands.run(["scontrol", "update", f"nodename={node.name}", "state=resume"])
