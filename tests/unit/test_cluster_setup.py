"""A cluster set up by a user without root: what the login node discovers (from Slurm's own output,
recorded on the lab and on sites' documented formats), the profile proposed from it, the user's
profiles file, and the interpreter each kind of training environment gives the job script."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml

from toolkit.cluster import discover as discovery
from toolkit.cluster.profile import (
    ClusterProfile,
    ProfileError,
    load_all,
    load_profile,
    read_user_entries,
    update_user_entry,
)
from toolkit.cluster.propose import Answers, propose
from toolkit.slurm import nodes as slurm_nodes
from toolkit.slurm.commands import CommandResult, SlurmCommandError

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
    """A command runner (commands.run's signature) that answers with recorded outputs."""
    def run(argv: list[str], timeout: float = 20, check: bool = True) -> CommandResult:
        result = CommandResult(tuple(argv), 1, "", "not recorded")
        for prefix, (code, text) in outputs.items():
            if " ".join(argv).startswith(prefix):
                result = CommandResult(tuple(argv), code, text if code == 0 else "", "" if code == 0 else text)
                break
        if check and result.returncode != 0:
            raise SlurmCommandError(f"`{' '.join(argv)}` failed: {result.stderr}")
        return result
    return run


SITE = {"sinfo --version": (0, "slurm 23.11.4\n"), "scontrol show partition": (0, PARTITIONS),
        "sinfo --Node": (0, NODES), "sacctmgr --noheader --parsable2 show qos": (0, "normal\nurgent\n"),
        "sacctmgr --noheader --parsable2 show associations": (0, "ml\nml\nphysics\n"),
        "sacctmgr --noheader --parsable2 show user": (0, "ml\n")}


def test_partitions_gres_and_mounts_are_read_from_slurms_own_formats():
    partitions = slurm_nodes.parse_partitions(PARTITIONS)
    assert partitions["cpu"].default and partitions["cpu"].max_nodes is None
    assert partitions["gpu"].max_nodes == 16 and partitions["gpu"].admits("physics", None)
    assert partitions["gpu"].admits("ml", None) is None
    assert partitions["high"].admits("ml", "low") and partitions["old"].state == "DOWN"
    assert slurm_nodes.parse_gres("gpu:h100:8(S:0-1),nic:2") == (8, "h100")
    assert slurm_nodes.parse_gres("gpu:4") == (4, "") and slurm_nodes.parse_gres("(null)") == (0, "")
    assert slurm_nodes.parse_gres("gpu:a100:4(S:0),gpu:a100:4(S:1)") == (8, "a100")
    nodes = slurm_nodes.parse_node_gres(NODES)
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


def put(name: str, body: dict) -> ClusterProfile:
    return update_user_entry(name, lambda entry: body)


def test_user_profiles_file_keeps_other_entries_and_refuses_a_bad_one_whole(profiles_file):
    put("alpha", {"extends": "lab", "shared_root": "/fsx/alpha"})
    put("beta", {"extends": "hyperpod", "default_account": "ml"})
    assert load_profile("alpha").tiers["standard"].partition == "standard"  # from lab
    before = profiles_file.read_text()
    for bad, message in [({"extends": "lab", "shared_root": "/has space"}, "shared_root"),
                         ({"extends": "lab", "environment": "venv"}, "needs python"),
                         ({"extends": "lab", "tiers": {}}, "standard tier"),
                         ({"extends": "lab", "container_runtime": "foo bar"}, "pyxis")]:
        with pytest.raises(ProfileError, match=message):
            put("gamma", bad)
    assert profiles_file.read_text() == before and set(read_user_entries()) == {"alpha", "beta"}
    assert profiles_file.stat().st_mode & 0o777 == 0o600


def test_entries_extend_each_other_in_any_order_and_a_loop_is_refused(profiles_file):
    profiles_file.write_text("child:\n  extends: parent\n  max_nodes: 2\nparent:\n  extends: lab\n  max_nodes: 3\n")
    assert load_profile("child").max_nodes == 2 and load_profile("child").shared_root == "/var/lib/ft-lab/shared"
    with pytest.raises(ProfileError, match="extend each other in a loop"):
        update_user_entry("parent", lambda entry: {**entry, "extends": "child"})
    assert load_profile("parent").max_nodes == 3  # not written


def test_a_broken_entry_written_by_hand_hides_no_other_profile(profiles_file):
    profiles_file.write_text("mine:\n  extends: lab\nbad:\n  extends: lab\n  gpus_per_node: -3\n"
                             "worse:\n  extends: bad\n")
    profiles, errors = load_all()
    assert "mine" in profiles and "lab" in profiles and set(errors) == {"bad", "worse"}
    with pytest.raises(ProfileError, match="gpus_per_node"):
        load_profile("bad")
    with pytest.raises(ProfileError, match="extends bad, which is broken"):
        load_profile("worse")
    # The others may still be changed, the broken ones mended or removed; no change may break one more.
    assert update_user_entry("mine", lambda entry: {**entry, "max_nodes": 2}).max_nodes == 2
    with pytest.raises(ProfileError, match="not changed"):
        update_user_entry("mine", lambda entry: {**entry, "max_nodes": -2})
    update_user_entry("worse", lambda entry: None)
    assert update_user_entry("bad", lambda entry: {"extends": "lab"}).name == "bad"
    assert load_all()[1] == {}


def test_cluster_set_changes_nested_fields_and_extends_a_builtin(profiles_file):
    def ft(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True,
                              env={"FT_CLUSTERS_FILE": str(profiles_file), "PATH": "/usr/bin:/bin"})

    done = ft("cluster", "set", "hyperpod", "tiers.standard.qos=normal", "default_account=12345", "max_nodes=8",
              "tiers.free.partition=0700", "nccl_env.NCCL_IB_TIMEOUT=22")
    assert done.returncode == 0, done.stderr
    entry = yaml.safe_load(profiles_file.read_text())["hyperpod"]
    assert entry["extends"] == "hyperpod" and entry["max_nodes"] == 8
    # Text stays text: an account named 12345, a partition named 0700 (not octal 448), NCCL's values.
    assert entry["default_account"] == "12345" and entry["tiers"]["free"]["partition"] == "0700"
    assert entry["nccl_env"]["NCCL_IB_TIMEOUT"] == "22" and entry["nccl_env"]["FI_PROVIDER"] == "efa"
    assert entry["tiers"]["standard"] == {"partition": "train", "qos": "normal", "price_per_gpu_hour": None}
    assert entry["tiers"]["premium"] == {"partition": "urgent", "qos": None, "price_per_gpu_hour": None}  # kept
    refused = ft("cluster", "set", "hyperpod", "gpus_per_node=-1")
    assert refused.returncode == 2 and "gpus_per_node" in refused.stderr and "Traceback" not in refused.stderr
    assert yaml.safe_load(profiles_file.read_text())["hyperpod"]["max_nodes"] == 8  # unchanged
    for bad, message in [("tiers.standard.partition.x=1", "not a mapping"), ("modules=[", "not a valid value"),
                         ("nosuchfield=1", "not a cluster profile field"), ("tiers=3", "tiers")]:
        refused = ft("cluster", "set", "hyperpod", bad, "tiers.standard.partition=x")
        assert refused.returncode == 2 and message in refused.stderr and "Traceback" not in refused.stderr, bad
    listed = json.loads(ft("cluster", "ls", "--json").stdout)
    assert {"name": "hyperpod", "yours": True}.items() <= next(r for r in listed if r["name"] == "hyperpod").items()
    assert ft("cluster", "rm", "hyperpod").returncode == 0 and "hyperpod" not in read_user_entries()
    assert ft("cluster", "rm", "hyperpod").returncode == 2


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


def test_cluster_add_refuses_a_shared_root_that_is_not_there(profiles_file, tmp_path):
    done = subprocess.run([sys.executable, "-m", "toolkit", "cluster", "add", "mine", "--extends", "lab", "--yes",
                           "--shared-root", str(tmp_path / "nowhere")], capture_output=True, text=True,
                          env={"FT_CLUSTERS_FILE": str(profiles_file), "PATH": "/usr/bin:/bin",
                               "SLURM_CONF": str(tmp_path / "no-slurm.conf")})
    assert done.returncode == 2 and "nowhere does not exist" in done.stderr and "Traceback" not in done.stderr
    assert not profiles_file.exists()  # nothing written


def test_the_environment_job_is_a_readable_script_bash_accepts(tmp_path):
    from toolkit.cluster.prepare import EnvPlace, render_job

    profile = load_profile("lab")
    place = EnvPlace(tmp_path / "envs" / "uid-1", "lab")
    script = render_job(profile, place, "0.1.0+abc", tmp_path / "ft-0.1.0-py3-none-any.whl", "python3",
                        offline=True, time_minutes=90)
    assert "#SBATCH --time=01:30:00" in script and "#SBATCH --partition=standard" in script
    assert "--no-index" in script and "uname -m" in script  # offline: the wheels must fit this node
    assert "#SBATCH --account=research" in script and "AWS_" not in script  # no secret is ever written
    path = tmp_path / "prepare.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    if shutil.which("shellcheck"):
        checked = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout
    online = render_job(profile, place, "0.1.0+abc", tmp_path / "ft.whl", "python3", offline=False)
    assert "--no-index" not in online
