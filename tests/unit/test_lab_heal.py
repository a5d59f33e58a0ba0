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


def test_a_resize_alone_skips_the_services_and_anything_else_runs_everything(tmp_path, monkeypatch):
    """`ft lab up --nodes N` on a lab otherwise as the last up left it visits only the nodes and Slurm
    (lab.yml's roles and tasks tagged `services` know no node count)."""
    import json

    applied = tmp_path / "applied.json"
    monkeypatch.setattr(lifecycle, "applied_path", lambda: applied)
    manifest = object()
    now = {"lab_node_count": 4}
    applied.write_text(json.dumps({"lab_node_count": 4, "services": lifecycle.services_fingerprint(now)}))
    assert lifecycle.resize_only({"lab_node_count": 5}, manifest)
    assert not lifecycle.resize_only({"lab_node_count": 4}, manifest)  # nothing to resize
    assert not lifecycle.resize_only({"lab_node_count": 5}, None)  # no lab yet
    applied.write_text(json.dumps({"lab_node_count": 4, "services": "an older ft's roles"}))
    assert not lifecycle.resize_only({"lab_node_count": 5}, manifest)
    applied.write_text(json.dumps({"lab_node_count": 4}))  # written before ft knew services apart
    assert not lifecycle.resize_only({"lab_node_count": 5}, manifest)
    tagged = (lifecycle.ansible_dir() / "lab.yml").read_text()
    for role in ("munge", "slurm_accounting", "ft_profile", "prometheus"):
        assert f"{{role: {role}, tags: [services]}}" in tagged
