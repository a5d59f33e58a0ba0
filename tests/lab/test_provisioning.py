"""The lab is provisioned by ft's Ansible roles: repeatable, checkable, and observable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from toolkit.lab import lifecycle
from toolkit.lab.provision import run_playbook


def ft(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, timeout=300)


def test_second_playbook_run_changes_nothing(lab):
    result = run_playbook("lab.yml", {"lab_node_count": len(lab.nodes)})

    assert result.ok, result.error
    assert result.changed == 0, f"tasks that changed on a provisioned lab: {result.changed_tasks}"


def test_check_mode_shows_a_config_change_as_a_diff_and_changes_nothing(lab):
    conf = Path(lab.slurm_conf)
    before = conf.read_bytes()
    log = []

    result = run_playbook("lab.yml", {"lab_node_count": len(lab.nodes), "slurm_slurmd_timeout": 42},
                          check=True, diff=True, on_task=log.append)

    assert result.ok, result.error
    assert "slurm : Write slurm.conf, gres.conf and cgroup.conf" in result.changed_tasks
    text = result.log_path.read_text()
    assert "-SlurmdTimeout=10" in text and "+SlurmdTimeout=42" in text
    assert conf.read_bytes() == before
    assert log, "the progress callback heard no task"


def test_lab_up_on_a_lab_that_is_up_says_so_and_changes_nothing(lab):
    before = Path(lab.slurm_conf).stat().st_mtime_ns
    outcome = lifecycle.up()

    assert outcome.playbook is None
    assert outcome.status.healthy
    assert Path(lab.slurm_conf).stat().st_mtime_ns == before

    shown = ft("lab", "up")
    assert shown.returncode == 0, shown.stderr
    assert "already up" in shown.stdout and "nothing changed" in shown.stdout


def test_lab_up_after_a_node_crash_heals_the_node_without_the_whole_playbook(lab):
    before = Path(lab.slurm_conf).stat().st_mtime_ns
    crashed = lab.nodes[-1].name
    assert lifecycle.crash(crashed), "nothing ran in the node's namespace"
    assert not lifecycle.collect(lab).healthy

    outcome = lifecycle.up()

    assert outcome.status.healthy, outcome.status.problems
    assert outcome.playbook is not None and "lab-heal" in outcome.playbook.log_path.name
    assert Path(lab.slurm_conf).stat().st_mtime_ns == before
    assert lifecycle.up().playbook is None  # healed: the next `ft lab up` has nothing to do


def test_lab_status_json_lists_every_daemon_and_node(lab):
    shown = ft("lab", "status", "--json")

    assert shown.returncode == 0, shown.stderr
    status = json.loads(shown.stdout)
    assert status["up"] and status["healthy"] and status["problems"] == []
    assert {d["name"] for d in status["daemons"]} >= {"munged", "slurmdbd", "slurmctld", "mariadb"}
    assert all(d["running"] and d["pid"] for d in status["daemons"])
    assert [n["name"] for n in status["nodes"]] == [n.name for n in lab.nodes]
    assert all(n["serving"] for n in status["nodes"])
    store = status["object_store"]  # on the bridge, so every node namespace reaches it
    assert store["answering"] and store["url"] == f"http://{lab.controller_address}:8333"
    assert set(store["buckets"].values()) == {"ft-checkpoints", "ft-models"}


def test_the_lab_object_store_serves_every_node_with_the_credentials_ft_lab_env_prints(lab):
    exports = ft("lab", "env").stdout
    env = dict(line.removeprefix("export ").split("=", 1) for line in exports.splitlines())
    assert env["AWS_ENDPOINT_URL"] == lab.object_store.url
    node = lab.nodes[-1]
    listed = subprocess.run(["nsenter", f"--net=/run/netns/{node.netns}", sys.executable, "-c",
                             "import s3fs; print(s3fs.S3FileSystem().ls('ft-checkpoints') is not None)"],
                            capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert listed.stdout.strip() == "True", listed.stderr[-2000:]
    refused = subprocess.run(["nsenter", f"--net=/run/netns/{node.netns}", sys.executable, "-c",
                              "import s3fs; s3fs.S3FileSystem().ls('ft-checkpoints')"], capture_output=True,
                             text=True, timeout=60, env={**os.environ, **env, "AWS_SECRET_ACCESS_KEY": "wrong"})
    assert refused.returncode != 0 and ("SignatureDoesNotMatch" in refused.stderr or "denied" in refused.stderr.lower())


def test_lab_publishes_ft_cluster_profile(lab):
    import yaml

    profile = yaml.safe_load(Path("/etc/ft/cluster.yaml").read_text())
    assert profile["name"] == "lab"
    assert profile["gpus_per_node"] == lab.gpus_per_node
    assert set(profile["tiers"]) == {"free", "standard", "premium"}
    assert {tier["partition"] for tier in profile["tiers"].values()} <= set(lab.partitions)
