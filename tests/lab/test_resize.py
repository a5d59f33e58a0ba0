"""`ft lab up --nodes N` grows and shrinks the running lab; the size sticks for later `ft lab up`."""

from __future__ import annotations

import subprocess

import pytest

from toolkit.lab import lifecycle
from toolkit.lab.manifest import LabManifest
from toolkit.slurm import commands

pytestmark = pytest.mark.whole_lab


def slurm_node_names() -> list[str]:
    out = commands.run(["sinfo", "--noheader", "--Node", "--format=%N"]).stdout
    return sorted(set(out.split()))  # a node in several partitions is listed once for each


def netns_names() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("ftlab-")}


def test_grow_then_shrink(whole_lab):
    original, slices = len(whole_lab.nodes), len(whole_lab.slices)
    try:
        grown = lifecycle.up(nodes=original + 1)
        assert grown.status.healthy, grown.status.problems
        assert len(slurm_node_names()) == original + 1
        assert f"ftlab-node{original + 1}" in netns_names()
        # Without --nodes, the lab keeps the size it has.
        again = lifecycle.up()
        assert again.playbook is None and len(again.status.nodes) == original + 1
    finally:
        shrunk = lifecycle.up(nodes=original)
    assert shrunk.status.healthy, shrunk.status.problems
    assert len(slurm_node_names()) == original
    assert netns_names() == {node.netns for node in whole_lab.nodes}
    assert len(LabManifest.load().nodes) == original and len(LabManifest.load().slices) == slices
