"""The lab is provisioned by ft's Ansible roles: repeatable, checkable, and observable."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.lab import lifecycle
from toolkit.lab.processes import daemon_pid
from toolkit.lab.provision import run_playbook
from toolkit.slurm import commands
from toolkit.slurm.nodes import SLURMD_PORT, slurmd_answers

pytestmark = pytest.mark.whole_lab  # its playbooks and `ft lab up` act on every node


def ft(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, timeout=300)


def test_check_mode_shows_a_config_change_as_a_diff_and_changes_nothing(whole_lab):
    conf = Path(whole_lab.slurm_conf)
    before = conf.read_bytes()
    log = []

    result = run_playbook("lab.yml", {**lifecycle.lab_vars(None, None, whole_lab), "slurm_slurmd_timeout": 42},
                          check=True, diff=True, on_task=log.append)

    assert result.ok, result.error
    assert "slurm : Write slurm.conf, gres.conf and cgroup.conf" in result.changed_tasks
    text = result.log_path.read_text()
    assert "-SlurmdTimeout=10" in text and "+SlurmdTimeout=42" in text
    assert conf.read_bytes() == before
    assert log, "the progress callback heard no task"


def test_a_cap_changed_by_hand_shows_in_check_mode_and_the_playbook_sets_it_back(whole_lab):
    """A site's check run is for drift: a cap raised with sacctmgr is a change (with a diff), and
    nothing is set until the playbook runs for real."""
    def cap() -> str:
        shown = subprocess.run(["sacctmgr", "--noheader", "--parsable2", "show", "associations", "account=capped",
                                "user=", "format=grptresmins"], capture_output=True, text=True, check=True)
        return shown.stdout.strip()

    provisioned = cap()
    assert provisioned == "gres/gpu=0"  # the lab's inventory: 0.01 GPU-hours, in whole minutes never looser
    subprocess.run(["sacctmgr", "--immediate", "modify", "account", "where", "name=capped", "set",
                    "GrpTRESMins=gres/gpu=600"], capture_output=True, check=True)
    try:
        checked = run_playbook("lab.yml", lifecycle.lab_vars(None, None, whole_lab), check=True, diff=True,
                               tags=("limits",))
        assert checked.ok, checked.error
        assert any("accounts' GPU-hour caps" in task for task in checked.changed_tasks), checked.changed_tasks
        text = checked.log_path.read_text()
        assert "-account capped: GrpTRESMins=gres/gpu=600" in text
        assert "+account capped: GrpTRESMins=gres/gpu=0" in text
        assert cap() == "gres/gpu=600"  # check mode set nothing
    finally:
        applied = run_playbook("lab.yml", lifecycle.lab_vars(None, None, whole_lab), tags=("limits",))
    assert applied.ok, applied.error
    assert cap() == provisioned


def test_lab_up_on_a_lab_that_is_up_says_so_and_changes_nothing(whole_lab):
    before = Path(whole_lab.slurm_conf).stat().st_mtime_ns
    outcome = lifecycle.up()

    assert outcome.playbook is None
    assert outcome.status.healthy
    assert Path(whole_lab.slurm_conf).stat().st_mtime_ns == before

    shown = ft("lab", "up")
    assert shown.returncode == 0, shown.stderr
    assert "already up" in shown.stdout and "nothing changed" in shown.stdout


def test_lab_up_after_a_node_crash_heals_the_node_without_the_whole_playbook(whole_lab):
    before = Path(whole_lab.slurm_conf).stat().st_mtime_ns
    crashed = whole_lab.nodes[-1]
    assert lifecycle.crash(crashed.name), "nothing ran in the node's namespace"
    assert not lifecycle.collect(whole_lab).healthy
    # As a node without power: silent. A connection to it is neither taken nor refused (a node whose
    # processes alone were killed would refuse it, and its peers would see their connections close).
    with pytest.raises(OSError) as silence:
        socket.create_connection((crashed.address, SLURMD_PORT), timeout=1).close()
    assert not isinstance(silence.value, ConnectionRefusedError), silence.value

    outcome = lifecycle.up()

    assert outcome.status.healthy, outcome.status.problems
    assert outcome.playbook is not None and "lab-heal" in outcome.playbook.log_path.name
    assert slurmd_answers(crashed.address)  # its link back with it
    assert Path(whole_lab.slurm_conf).stat().st_mtime_ns == before
    assert lifecycle.up().playbook is None  # healed: the next `ft lab up` has nothing to do


def test_a_second_run_changes_nothing_but_a_daemon_on_code_older_than_the_checkout(whole_lab):
    """The playbook is idempotent, and `ft lab up` restarts an ft daemon whose code changed, alone."""
    signer, exporter = (next(d for d in whole_lab.daemons if d.name == name)
                        for name in ("ft-signer", "ft-cluster-metrics"))
    record = Path(signer.code)
    written = json.loads(record.read_text())
    pids = {daemon.name: daemon_pid(daemon) for daemon in (signer, exporter)}
    # As if ft's code the signer loaded had changed since it started (the test changes no code).
    record.write_text(json.dumps({**written, "digest": "0" * 64}))

    shown = json.loads(ft("lab", "status", "--json").stdout)
    assert shown["problems"] == ["ft-signer runs ft's code from before it last changed: `ft lab up` restarts it"]
    assert [d["stale"] for d in shown["daemons"] if d["name"] == "ft-signer"] == [True]

    outcome = lifecycle.up()

    assert outcome.status.healthy, outcome.status.problems
    assert outcome.playbook is not None and outcome.playbook.ok, outcome.playbook.error
    assert outcome.playbook.changed_tasks == ["ft_signer : The record of ft's code the receipt signer loads",
                                              "ft_signer : Start the receipt signer (no systemd)"]
    assert json.loads(record.read_text()) == written  # the record of the code it runs now
    assert daemon_pid(signer) not in (None, pids["ft-signer"])  # restarted
    assert daemon_pid(exporter) == pids["ft-cluster-metrics"]  # its code did not change: left alone
    assert lifecycle.up().playbook is None


def test_lab_status_json_lists_every_daemon_and_node(whole_lab):
    shown = ft("lab", "status", "--json")

    assert shown.returncode == 0, shown.stderr
    status = json.loads(shown.stdout)
    assert status["up"] and status["healthy"] and status["problems"] == []
    assert {d["name"] for d in status["daemons"]} >= {"munged", "slurmdbd", "slurmctld", "mariadb"}
    assert all(d["running"] and d["pid"] for d in status["daemons"])
    assert [n["name"] for n in status["nodes"]] == [n.name for n in whole_lab.nodes]
    assert all(n["serving"] for n in status["nodes"])
    store = status["object_store"]  # on the bridge, so every node namespace reaches it
    assert store["answering"] and store["url"] == f"http://{whole_lab.controller_address}:8333"
    assert set(store["buckets"].values()) == {"ft-checkpoints", "ft-models"}


def test_the_lab_object_store_serves_every_node_with_the_credentials_ft_lab_env_prints(whole_lab):
    exports = ft("lab", "env").stdout
    env = dict(line.removeprefix("export ").split("=", 1) for line in exports.splitlines())
    assert env["AWS_ENDPOINT_URL"] == whole_lab.object_store.url
    node = whole_lab.nodes[-1]
    listed = subprocess.run(["nsenter", f"--net=/run/netns/{node.netns}", sys.executable, "-c",
                             "import s3fs; print(s3fs.S3FileSystem().ls('ft-checkpoints') is not None)"],
                            capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert listed.stdout.strip() == "True", listed.stderr[-2000:]
    refused = subprocess.run(["nsenter", f"--net=/run/netns/{node.netns}", sys.executable, "-c",
                              "import s3fs; s3fs.S3FileSystem().ls('ft-checkpoints')"], capture_output=True,
                             text=True, timeout=60, env={**os.environ, **env, "AWS_SECRET_ACCESS_KEY": "wrong"})
    assert refused.returncode != 0 and ("SignatureDoesNotMatch" in refused.stderr or "denied" in refused.stderr.lower())


def test_lab_publishes_ft_cluster_profile(whole_lab):
    import yaml

    profile = yaml.safe_load(Path("/etc/ft/cluster.yaml").read_text())
    assert profile["name"] == "lab"
    assert profile["gpus_per_node"] == whole_lab.gpus_per_node
    assert set(profile["tiers"]) == {"free", "standard", "premium"}
    assert {tier["partition"] for tier in profile["tiers"].values()} <= set(whole_lab.partitions)


def test_each_slice_has_partitions_on_its_own_nodes_and_a_profile_naming_them(whole_lab):
    import yaml

    if len(whole_lab.slices) < 2:
        pytest.skip("a lab of one slice (scripts/test.sh brings it up in two: `ft lab up --nodes 8 --slices 2`)")
    seen = {}
    for line in commands.run(["sinfo", "--noheader", "--Node", "--format=%N %P"]).stdout.splitlines():
        node, partition = line.split()
        seen.setdefault(partition.rstrip("*"), set()).add(node)
    owned = set()
    for part in whole_lab.slices:
        profile = yaml.safe_load(Path(part.profile).read_text())
        assert {tier: target["partition"] for tier, target in profile["tiers"].items()} == part.tiers
        for partition in part.tiers.values():
            assert seen[partition] == set(part.nodes), partition
        assert not owned & set(part.nodes)
        owned |= set(part.nodes)
    assert owned == {node.name for node in whole_lab.nodes}
