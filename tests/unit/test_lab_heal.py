"""What `ft lab up` does for a lab that is up but not healthy: a crashed node's slurmd is started
again (lab-heal.yml), and a node slurmctld has not heard from since a fault is given a few pings,
not the whole playbook (which would change nothing for it, in half a minute)."""

from __future__ import annotations

from toolkit.lab import lifecycle
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
    monkeypatch.setattr(lifecycle, "node_count", lambda nodes, manifest: 1)
    monkeypatch.setattr(lifecycle, "as_last_up", lambda extra_vars, manifest: True)
    monkeypatch.setattr(lifecycle, "collect", lambda manifest: next(answers))
    monkeypatch.setattr(lifecycle.time, "sleep", lambda s: None)
    played = []
    monkeypatch.setattr(lifecycle, "run_playbook", lambda name, *a, **k: played.append(name))
    outcome = lifecycle.up()
    assert outcome.status.healthy and outcome.playbook is None and played == []
