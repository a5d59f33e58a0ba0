"""What `ft lab up` does for a lab that is up but not healthy: a crashed node's slurmd is started
again (lab-heal.yml), and a node slurmctld has not heard from since a fault is given a few pings,
not the whole playbook (which would change nothing for it, in half a minute)."""

from __future__ import annotations

import subprocess

import pytest

from toolkit.base.errors import FtError, UsageError
from toolkit.lab import lifecycle
from toolkit.lab.manifest import LabDaemon, LabManifest, LabNode, LabSlice
from toolkit.lab.status import DaemonStatus, LabStatus, NodeStatus


def status(*nodes: NodeStatus, daemons=None, problems=None) -> LabStatus:
    daemons = daemons or [DaemonStatus("slurmctld", 10), *(DaemonStatus(f"slurmd {n.name}", 20, n.name)
                                                           for n in nodes)]
    problems = problems if problems is not None else [f"{n.name} is {n.state}" for n in nodes if not n.serving]
    return LabStatus("lab", True, daemons, list(nodes), problems)


def node(name: str, state: str = "idle", *flags: str) -> NodeStatus:
    return NodeStatus(name, "10.0.0.1", True, state, list(flags))


def test_a_node_not_heard_from_since_a_fault_is_waited_for():
    assert lifecycle.only_nodes_unheard(status(node("node1"), node("node2", "idle", "NOT_RESPONDING")))


def test_once_healed_a_node_the_health_check_drained_is_waited_for_and_an_admins_drain_is_not():
    checked = node("node2", "idle", "DRAIN")
    checked.reason = "ft-healthcheck: gpu_count: 3 of 4 GPUs visible to the driver"
    assert lifecycle.only_nodes_unheard(status(checked), after_heal=True)
    assert not lifecycle.only_nodes_unheard(status(checked))  # before the heal: its GPU is still missing
    by_admin = node("node2", "idle", "DRAIN")
    by_admin.reason = "admin: maintenance"
    assert not lifecycle.only_nodes_unheard(status(by_admin), after_heal=True)


def test_only_nodes_wrong_are_healed_and_anything_else_is_the_whole_playbooks():
    crashed = status(node("node1"), node("node2", "down", "NOT_RESPONDING"),
                     daemons=[DaemonStatus("slurmctld", 10), DaemonStatus("slurmd node1", 20, "node1"),
                              DaemonStatus("slurmd node2", None, "node2")],
                     problems=["slurmd node2 is not running", "node2 is down+NOT_RESPONDING"])
    assert lifecycle.nodes_to_heal(crashed) == ["node2"]
    just_crashed = status(node("node1"), node("node2"),  # Slurm has not noticed yet
                          daemons=[DaemonStatus("slurmctld", 10), DaemonStatus("slurmd node2", None, "node2")],
                          problems=["slurmd node2 is not running"])
    assert lifecycle.nodes_to_heal(just_crashed) == ["node2"]
    gpu_gone = node("node3", "idle", "DRAIN")
    assert lifecycle.nodes_to_heal(status(node("node1"), gpu_gone)) == ["node3"]
    assert lifecycle.nodes_to_heal(status(node("node1"))) == []  # nothing wrong
    assert lifecycle.nodes_to_heal(status(node("node2", "down"), problems=["node2 is down", "Prometheus at x does "
                                                                          "not answer"])) == []
    controller_down = status(node("node2", "down"), daemons=[DaemonStatus("slurmctld", None)])
    assert lifecycle.nodes_to_heal(controller_down) == []
    no_bridge = LabStatus("lab", False, [DaemonStatus("slurmctld", 10)], [node("node2", "down")], ["bridge down"])
    assert lifecycle.nodes_to_heal(no_bridge) == []


def test_a_drained_node_or_anything_else_wrong_is_not_waited_for():
    assert not lifecycle.only_nodes_unheard(status(node("node1")))  # nothing to wait for
    assert not lifecycle.only_nodes_unheard(status(node("node2", "idle", "NOT_RESPONDING", "DRAIN")))
    assert not lifecycle.only_nodes_unheard(status(node("node2", "down")))
    assert not lifecycle.only_nodes_unheard(status(node("node2", "idle", "NOT_RESPONDING"),
                                                   problems=["node2 is idle", "Prometheus does not answer"]))
    crashed = status(node("node2", "idle", "NOT_RESPONDING"),
                     daemons=[DaemonStatus("slurmctld", 10), DaemonStatus("slurmd node2", None, "node2")])
    assert not lifecycle.only_nodes_unheard(crashed)  # lab-heal.yml's, first


def test_up_waits_for_the_next_ping_instead_of_running_the_playbook(monkeypatch):
    """Slurm and the playbook stood in for: the lab tests heal real nodes this way (heal_lab)."""
    answers = iter([status(node("node2", "idle", "NOT_RESPONDING"))] * 2 + [status(node("node2"))])
    monkeypatch.setattr(lifecycle, "require_root", lambda action: None)
    monkeypatch.setattr(lifecycle.LabManifest, "load", classmethod(lambda cls: None))
    monkeypatch.setattr(lifecycle, "lab_vars", lambda nodes, slices, manifest, slurm: {"lab_node_count": 1})
    monkeypatch.setattr(lifecycle, "as_last_up", lambda extra_vars, manifest: True)
    monkeypatch.setattr(lifecycle, "collect", lambda manifest: next(answers))
    monkeypatch.setattr(lifecycle.time, "sleep", lambda s: None)
    played = []
    monkeypatch.setattr(lifecycle, "run_playbook", lambda name, *a, **k: played.append(name))
    outcome = lifecycle.up()
    assert outcome.status.healthy and outcome.playbook is None and played == []


def test_a_resize_alone_skips_the_services_and_anything_else_runs_everything(tmp_path, monkeypatch):
    """`ft lab up --nodes N` on a lab otherwise as the last up left it visits only the nodes and Slurm
    (lab.yml's roles and tasks tagged `services` know no node count)."""
    import json

    applied = tmp_path / "applied.json"
    monkeypatch.setattr(lifecycle, "applied_path", lambda: applied)
    manifest = object()
    now = {"lab_node_count": 4}
    applied.write_text(json.dumps({"lab_node_count": 4, "services": lifecycle.services_fingerprint(now)}))
    assert lifecycle.resize_only({"lab_node_count": 5, "lab_slices": 1}, manifest)
    assert lifecycle.resize_only({"lab_node_count": 8, "lab_slices": 2}, manifest)  # slices are its shape too
    assert not lifecycle.resize_only({"lab_node_count": 4, "lab_slices": 1}, manifest)  # nothing to resize
    assert not lifecycle.resize_only({"lab_node_count": 5, "lab_slices": 1}, None)  # no lab yet
    applied.write_text(json.dumps({"lab_node_count": 4, "services": "an older ft's roles"}))
    assert not lifecycle.resize_only({"lab_node_count": 5, "lab_slices": 1}, manifest)
    applied.write_text(json.dumps({"lab_node_count": 4}))  # written before ft knew services apart
    assert not lifecycle.resize_only({"lab_node_count": 5, "lab_slices": 1}, manifest)
    tagged = (lifecycle.ansible_dir() / "lab.yml").read_text()
    for role in ("munge", "slurm_accounting", "ft_profile", "prometheus"):
        assert f"{{role: {role}, tags: [services]}}" in tagged


def test_the_lab_keeps_its_shape_unless_asked_and_a_slice_needs_a_node():
    package = {"slurm_release": ""}  # Debian's 22.05
    assert lifecycle.lab_vars(None, None, None) == {"lab_node_count": 4, "lab_slices": 1} | package
    sliced = lab_manifest(8, slices=2)
    assert lifecycle.lab_vars(None, None, sliced) == {"lab_node_count": 8, "lab_slices": 2} | package
    assert lifecycle.lab_vars(9, None, sliced) == {"lab_node_count": 9, "lab_slices": 2} | package  # kept
    assert lifecycle.lab_vars(None, 1, sliced) == {"lab_node_count": 8, "lab_slices": 1} | package
    with pytest.raises(UsageError, match="--slices 3 does not fit 2 lab nodes"):
        lifecycle.lab_vars(2, 3, None)
    assert isinstance(sliced.slices[1], LabSlice)


def test_the_lab_keeps_its_slurm_release_unless_asked_and_knows_which_it_runs():
    import dataclasses

    on_24 = dataclasses.replace(lab_manifest(4, slices=1), slurm="24.11")
    assert lifecycle.lab_vars(None, None, on_24)["slurm_release"] == "24.11"  # a resize keeps it
    assert lifecycle.lab_vars(None, None, on_24, "22.05")["slurm_release"] == ""  # back to Debian's
    assert lifecycle.lab_vars(None, None, None, "26.05")["slurm_release"] == "26.05"
    with pytest.raises(UsageError, match="--slurm 23.02 is not a release the lab runs") as refused:
        lifecycle.lab_vars(None, None, None, "23.02")
    assert "24.11" in refused.value.hint


def lab_manifest(count: int, slices: int):
    names = [f"node{i}" for i in range(1, count + 1)]
    size = count // slices
    parts = [LabSlice(k, tuple(names[(k - 1) * size: k * size if k < slices else count]),
                      {t: (t if k == 1 else f"s{k}-{t}") for t in ("free", "standard", "premium")},
                      "/etc/ft/cluster.yaml" if k == 1 else f"/lab/ft-profile-s{k}.yaml")
             for k in range(1, slices + 1)]
    return LabManifest("lab", "10.0.0.0/24", "br", "ctl", "10.0.0.1",
                       tuple(LabNode(n, "10.0.0.9", f"ftlab-{n}", 4) for n in names), 4,
                       tuple(p for s in parts for p in s.tiers.values()), "/etc/slurm/slurm.conf", "/shared", "/log",
                       (LabDaemon("slurmctld", "slurmctld", "/run/ctld.pid"),
                        *(LabDaemon(f"slurmd {n}", "slurmd", f"/run/{n}.pid", f"ftlab-{n}", n) for n in names)),
                       slices=tuple(parts))


def test_a_slices_view_holds_its_nodes_daemons_and_tiers_and_the_controllers_daemons():
    view = lab_manifest(8, slices=2).slice(2)
    assert [n.name for n in view.nodes] == ["node5", "node6", "node7", "node8"]
    assert [d.name for d in view.daemons] == ["slurmctld"] + [f"slurmd node{i}" for i in range(5, 9)]
    assert view.tiers == {"free": "s2-free", "standard": "s2-standard", "premium": "s2-premium"}
    assert view.slices[0].profile == "/lab/ft-profile-s2.yaml"
    assert lab_manifest(8, slices=2).slice(1).tiers["standard"] == "standard"
    with pytest.raises(UsageError, match="no slice 3"):
        lab_manifest(8, slices=2).slice(3)


class OneNodeLab:
    """The lab's description, for a crash (the namespace itself never touched: `ip` is a stand-in)."""

    @staticmethod
    def load():
        return OneNodeLab()

    def node(self, name):
        return LabNode(name, "10.213.7.11", "ftlab-node1", 4)


def test_a_crash_cuts_the_nodes_link_before_it_kills_anything(monkeypatch):
    """A power loss says nothing: the link goes first, so no process's end is seen closing its
    connections. (The lab's provisioning test crashes a real node and finds it silent.)"""
    from toolkit.lab import processes

    steps = []
    monkeypatch.setattr(lifecycle, "require_root", lambda *args: None)
    monkeypatch.setattr(lifecycle, "LabManifest", OneNodeLab)
    monkeypatch.setattr(lifecycle, "netns_exists", lambda netns: True)
    monkeypatch.setattr(processes.subprocess, "run", lambda command, **kwargs: steps.append(command))
    monkeypatch.setattr(lifecycle, "kill_netns", lambda netns: steps.append(("kill", netns)) or [7])
    assert lifecycle.crash("node1") == [7]
    assert steps == [["ip", "-n", "ftlab-node1", "link", "set", "eth0", "down"], ("kill", "ftlab-node1")]


def test_a_crash_whose_link_cannot_be_cut_still_kills_and_says_it_was_no_power_loss(monkeypatch):
    from toolkit.lab import processes

    killed = []

    def refused(command, **kwargs):
        raise subprocess.CalledProcessError(2, command, stderr=b'Cannot find device "eth0"')

    monkeypatch.setattr(lifecycle, "require_root", lambda *args: None)
    monkeypatch.setattr(lifecycle, "LabManifest", OneNodeLab)
    monkeypatch.setattr(lifecycle, "netns_exists", lambda netns: True)
    monkeypatch.setattr(processes.subprocess, "run", refused)
    monkeypatch.setattr(lifecycle, "kill_netns", lambda netns: killed.append(netns) or [7, 8])
    with pytest.raises(FtError) as refusal:
        lifecycle.crash("node1")
    assert killed == ["ftlab-node1"]
    message = refusal.value.message
    assert "killed 2 processes of node1" in message and 'Cannot find device "eth0"' in message
    assert "ft lab up" in refusal.value.hint

    monkeypatch.setattr(lifecycle, "netns_exists", lambda netns: False)  # no namespace: nothing done
    killed.clear()
    with pytest.raises(FtError, match="no namespace"):
        lifecycle.crash("node1")
    assert killed == []
