"""A cluster set up by a user without root: what the login node discovers (from Slurm's own output,
recorded on the lab and on sites' documented formats), the profile proposed from it, the user's
profiles file, and the interpreter each kind of training environment gives the job script."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from toolkit.cluster import discover as discovery
from toolkit.cluster.profile import ClusterProfile, ProfileError, load_profile, read_user_entries, save_user_entry
from toolkit.cluster.propose import Answers, propose
from toolkit.slurm.commands import CommandResult

# `scontrol show partition --oneliner` as the lab's Slurm 22.05 printed it, shortened, plus a site's
# GPU partitions: one only some accounts may use, one down.
PARTITIONS = "".join(line + "\n" for line in [
    "PartitionName=cpu AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL Default=YES QoS=N/A MaxNodes=UNLIMITED "
    "MaxTime=1-00:00:00 PriorityTier=1 State=UP TotalCPUs=64 TotalNodes=2",
    "PartitionName=gpu AllowGroups=ALL AllowAccounts=ml,vision AllowQos=ALL Default=NO QoS=N/A MaxNodes=16 "
    "MaxTime=2-00:00:00 PriorityTier=2 State=UP TotalNodes=32",
    "PartitionName=high AllowGroups=ALL AllowAccounts=ALL AllowQos=normal,urgent Default=NO QoS=N/A "
    "MaxNodes=UNLIMITED MaxTime=UNLIMITED PriorityTier=3 State=UP TotalNodes=32",
    "PartitionName=old AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL Default=NO MaxNodes=UNLIMITED State=DOWN "
    "TotalNodes=4",
])
NODES = """\
cpu1|cpu*|(null)
gpu1|gpu|gpu:h100:8(S:0-1)
gpu1|high|gpu:h100:8(S:0-1)
gpu2|gpu|gpu:h100:4(S:0),nic:2
"""
MOUNTS = """\
/dev/vda1 / ext4 rw 0 0
10.0.0.5@tcp:/fsx /fsx lustre rw 0 0
nfs01:/home /home nfs4 rw 0 0
tmpfs /tmp tmpfs rw 0 0
"""


def recorded(outputs: dict[str, tuple[int, str]]):
    def run(argv: list[str]) -> CommandResult:
        for prefix, (code, text) in outputs.items():
            if " ".join(argv).startswith(prefix):
                return CommandResult(tuple(argv), code, text if code == 0 else "", "" if code == 0 else text)
        return CommandResult(tuple(argv), 1, "", "not recorded")
    return run


SITE = {"sinfo --version": (0, "slurm 23.11.4\n"), "scontrol show partition": (0, PARTITIONS),
        "sinfo --Node": (0, NODES), "sacctmgr --noheader --parsable2 show qos": (0, "normal\nurgent\n"),
        "sacctmgr --noheader --parsable2 show associations": (0, "ml\nml\nphysics\n"),
        "sacctmgr --noheader --parsable2 show user": (0, "ml\n")}


def test_partitions_gres_and_mounts_are_read_from_slurms_own_formats():
    partitions = discovery.parse_partitions(PARTITIONS)
    assert partitions["cpu"].default and partitions["cpu"].max_nodes is None
    assert partitions["gpu"].max_nodes == 16 and partitions["gpu"].admits("physics", None)
    assert partitions["gpu"].admits("ml", None) is None
    assert partitions["high"].admits("ml", "low") and partitions["old"].state == "DOWN"
    assert discovery.parse_gres("gpu:h100:8(S:0-1),nic:2") == (8, "h100")
    assert discovery.parse_gres("gpu:4") == (4, "") and discovery.parse_gres("(null)") == (0, "")
    assert discovery.parse_gres("gpu:a100:4(S:0),gpu:a100:4(S:1)") == (8, "a100")
    nodes = discovery.parse_nodes(NODES)
    assert nodes["gpu1"].partitions == ["gpu", "high"] and nodes["cpu1"].partitions == ["cpu"]
    assert discovery.shared_filesystems(MOUNTS, {"SCRATCH": "/scratch/me", "WORK": "relative"}) == [
        "/fsx", "/home", "/scratch/me"]


def test_discovery_reads_versions_accounts_and_what_it_could_not():
    found = discovery.discover(recorded(SITE), user="me")
    assert found.slurm_version == "23.11.4" and found.accounts == ["ml", "physics"]
    assert found.default_account == "ml" and found.qos == ["normal", "urgent"]
    assert found.gpus_in("gpu") == (8, "h100") and found.default_partition == "cpu"
    no_accounting = {key: value for key, value in SITE.items() if not key.startswith("sacctmgr")}
    no_accounting["sacctmgr"] = (1, "sacctmgr: error: Problem talking to the database")
    found = discovery.discover(recorded(no_accounting), user="me")
    assert found.accounts == [] and "database" in found.unread["accounts"] and found.partitions
    found = discovery.discover(recorded({}), user="me")
    assert not found.slurm_version and found.unread["slurm"]


def test_proposal_maps_tiers_by_name_and_says_where_each_value_came_from():
    found = discovery.discover(recorded(SITE), user="me")
    proposal = propose(found, Answers(tiers={"standard": "gpu:normal"}))
    assert proposal.body["tiers"] == {"free": {"partition": "gpu", "qos": "normal"},
                                      "standard": {"partition": "gpu", "qos": "normal"},
                                      "premium": {"partition": "high"}}
    assert proposal.body["gpus_per_node"] == 8 and "GRES" in proposal.sources["gpus_per_node"]
    assert proposal.body["max_nodes"] == 16 and proposal.body["default_account"] == "ml"
    assert proposal.missing == ["shared_root"]  # only a person can tell which filesystem to use
    with pytest.raises(ProfileError, match="unknown tier"):
        propose(found, Answers(tiers={"gold": "gpu"}))


def test_proposal_takes_partitions_named_like_tiers_else_the_default_partition():
    found = discovery.discover(recorded(SITE | {"sacctmgr --noheader --parsable2 show user": (0, "")}), user="me")
    proposal = propose(found, Answers(shared_root="/fsx/me/"))
    assert proposal.body["tiers"]["standard"] == {"partition": "gpu"}  # named like a tier, over the default
    assert proposal.body["tiers"]["premium"] == {"partition": "high"}
    found.partitions = {name: p for name, p in found.partitions.items() if name in ("cpu", "old")}
    tiers = propose(found, Answers()).body["tiers"]
    assert tiers["standard"] == tiers["free"] == {"partition": "cpu"}  # the default; "old" is down
    assert proposal.body["shared_root"] == "/fsx/me" and "default_account" in proposal.missing  # two accounts


@pytest.fixture
def profiles_file(tmp_path, monkeypatch):
    path = tmp_path / "clusters.yaml"
    monkeypatch.setenv("FT_CLUSTERS_FILE", str(path))
    return path


def test_user_profiles_file_keeps_other_entries_and_refuses_a_bad_one_whole(profiles_file):
    save_user_entry("alpha", {"extends": "lab", "shared_root": "/fsx/alpha"})
    save_user_entry("beta", {"extends": "hyperpod", "default_account": "ml"})
    assert load_profile("alpha").tiers["standard"].partition == "standard"  # from lab
    with pytest.raises(ProfileError, match="already has a profile 'alpha'"):
        save_user_entry("alpha", {"extends": "lab"})
    before = profiles_file.read_text()
    with pytest.raises(ProfileError, match="shared_root"):
        save_user_entry("gamma", {"extends": "lab", "shared_root": "/has space"})
    with pytest.raises(ProfileError, match="needs python"):
        save_user_entry("delta", {"extends": "lab", "environment": "venv"})
    assert profiles_file.read_text() == before and set(read_user_entries()) == {"alpha", "beta"}
    assert profiles_file.stat().st_mode & 0o777 == 0o600


def test_cluster_set_changes_nested_fields_and_extends_a_builtin(profiles_file):
    def ft(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True,
                              env={"FT_CLUSTERS_FILE": str(profiles_file), "PATH": "/usr/bin:/bin"})

    done = ft("cluster", "set", "hyperpod", "tiers.standard.qos=normal", "default_account=ml", "max_nodes=8")
    assert done.returncode == 0, done.stderr
    entry = yaml.safe_load(profiles_file.read_text())["hyperpod"]
    assert entry["extends"] == "hyperpod" and entry["max_nodes"] == 8
    assert entry["tiers"]["standard"] == {"partition": "train", "qos": "normal"}
    assert entry["tiers"]["premium"] == {"partition": "urgent", "qos": None}  # the rest kept
    refused = ft("cluster", "set", "hyperpod", "gpus_per_node=-1")
    assert refused.returncode == 2 and "gpus_per_node" in refused.stderr and "Traceback" not in refused.stderr
    assert yaml.safe_load(profiles_file.read_text())["hyperpod"]["max_nodes"] == 8  # unchanged
    listed = json.loads(ft("cluster", "ls", "--json").stdout)
    assert {"name": "hyperpod", "yours": True}.items() <= next(r for r in listed if r["name"] == "hyperpod").items()


def test_each_environment_gives_the_job_its_interpreter():
    site = ClusterProfile(name="site", gpus_per_node=8, tiers={"standard": {"partition": "gpu"}})
    assert site.training_python("/login/venv/bin/python") == "/login/venv/bin/python"
    venv = site.model_copy(update={"environment": "venv", "python": "/fsx/envs/ft-x/bin/python"})
    assert venv.training_python("/login/py") == venv.batch_python("/login/py") == "/fsx/envs/ft-x/bin/python"
    container = ClusterProfile(name="cw", gpus_per_node=8, tiers={"standard": {"partition": "gpu"}},
                               environment="container", container_runtime="pyxis", container_image="nvcr.io#ft")
    # srun's steps run in the image; the batch script's own steps run on the host.
    assert container.training_python("/home/me/.local/share/ft/venv/bin/python") == "python3"
    assert container.batch_python("/home/me/.local/share/ft/venv/bin/python").startswith("/home/me")
    with pytest.raises(ValueError, match="container_image"):
        ClusterProfile(name="x", gpus_per_node=1, tiers={"standard": {"partition": "p"}}, environment="container")
