"""`ft doctor`'s verdicts without a cluster: the login checks against a discovered cluster (Slurm's
recorded output), the compute checks' pieces, and how the preflight step's output is read. The lab
test (tests/lab/test_user_setup.py) runs the same checks for real, as a user without root."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from toolkit.base.build import build_id
from toolkit.cluster.discover import Discovery
from toolkit.cluster.profile import ClusterProfile
from toolkit.doctor import login, preflight
from toolkit.doctor import node as compute
from toolkit.slurm.nodes import NodeGpus, Partition


@pytest.fixture
def cluster() -> Discovery:
    return Discovery(user="carol", slurm_version="23.11.4",
                     partitions={"gpu": Partition("gpu", default=True), "cpu": Partition("cpu"),
                                 "vip": Partition("vip", allow_accounts="board")},
                     nodes={"g1": NodeGpus("g1", ["gpu", "vip"], 8, "h100", 96, 1_000_000),
                            "c1": NodeGpus("c1", ["cpu"], 0, "", 32, 64_000)},
                     qos=["normal", "high"], accounts=["ml", "research"], default_account="ml",
                     account_qos={"ml": ["normal"], "research": ["normal", "high"]}, enforces_associations=True)


def profile(tmp_path: Path, **fields) -> ClusterProfile:
    base = {"name": "mine", "gpus_per_node": 8, "tiers": {"standard": {"partition": "gpu"}},
            "shared_root": str(tmp_path), "default_account": "ml", "cpus_per_node": 96,
            "memory_per_node_mb": 1_000_000}
    return ClusterProfile.model_validate(base | fields)


def verdicts(findings) -> dict[str, str]:
    return {f.check: f.level for f in findings}


def test_a_sound_profile_has_no_blocker(tmp_path, cluster):
    findings = login.login_checks(profile(tmp_path), cluster)
    assert all(f.level == "ok" for f in findings), findings


def test_what_jobs_ask_of_a_node_is_checked_against_the_nodes(tmp_path, cluster):
    """Where Slurm confines jobs (cgroups), a job gets the cores it asks for: the profile must say
    how many its nodes have (or that nodes are given whole), and never more than they have."""
    unknown = login.check_node_size(profile(tmp_path, cpus_per_node=None), cluster)
    assert [(f.level, f.fix) for f in unknown] == [("warn", "ft cluster set mine cpus_per_node=96, or "
                                                            "exclusive_nodes=true where nodes are given whole")]
    assert "a core per rank" in unknown[0].detail
    too_many = login.check_node_size(profile(tmp_path, cpus_per_node=128), cluster)
    assert [(f.level, f.fix) for f in too_many] == [("blocker", "ft cluster set mine cpus_per_node=96")]
    too_much = login.check_node_size(profile(tmp_path, memory_per_node_mb=2_000_000), cluster)
    assert [f.level for f in too_much] == ["blocker"] and "1000000" in too_much[0].fix
    whole = login.check_node_size(profile(tmp_path, cpus_per_node=None, exclusive_nodes=True), cluster)
    assert [f.level for f in whole] == ["ok"]


@pytest.mark.parametrize(("fields", "check", "detail", "fix"), [
    ({"tiers": {"standard": {"partition": "gpux"}}}, "partition", "partition 'gpux' does not exist",
     "ft cluster set mine tiers.standard.partition=gpu"),
    ({"tiers": {"standard": {"partition": "gpu", "qos": "hihg"}}}, "qos", "QOS 'hihg' does not exist",
     "tiers.standard.qos=high"),
    ({"tiers": {"standard": {"partition": "gpu", "qos": "high"}}}, "partition",
     "account ml may use QOS normal, not high", "default_account"),
    ({"tiers": {"standard": {"partition": "vip"}}, "default_account": None}, "partition",
     "admits accounts board only", "default_account"),  # checked against the user's own default account
    ({"default_account": "physics"}, "account", "no association with Slurm account 'physics'",
     "default_account=ml"),
    ({"tiers": {"standard": {"partition": "cpu"}}}, "gpus", "no node of partition cpu has GPUs as GRES", "GresTypes"),
    ({"tiers": {"standard": {"partition": "vip"}}}, "partition", "admits accounts board only", "default_account"),
    ({"gpus_per_node": 16}, "gpus", "have 8 GPUs, the profile asks 16", "gpus_per_node=8"),
    ({"shared_root": "/nonexistent/ft"}, "shared_root", "/nonexistent/ft does not exist", "ft cluster set mine"),
    ({"environment": "venv", "python": "/nonexistent/envs/ft-x/bin/python"}, "environment",
     "missing or incomplete", "ft cluster prepare mine"),
])
def test_each_broken_setup_is_named_with_its_fix(tmp_path, cluster, fields, check, detail, fix):
    findings = [f for f in login.login_checks(profile(tmp_path, **fields), cluster) if f.level == "blocker"]
    assert [f.check for f in findings] == [check], findings
    assert detail in findings[0].detail and fix in findings[0].fix


def test_a_venv_of_other_code_than_the_login_nodes_is_a_blocker(tmp_path, cluster):
    venv = tmp_path / "envs" / "ft-old"
    (venv / "bin").mkdir(parents=True)
    (venv / ".ft-build").write_text("0.1.0+000000000000\n")
    findings = login.check_environment(profile(tmp_path, environment="venv", python=str(venv / "bin" / "python")))
    assert findings[0].level == "blocker" and "0.1.0+000000000000" in findings[0].detail
    (venv / ".ft-build").write_text(build_id())
    assert login.check_environment(profile(tmp_path, environment="venv",
                                           python=str(venv / "bin" / "python")))[0].level == "ok"


def test_no_association_where_slurm_enforces_them_is_a_blocker(tmp_path, cluster):
    cluster.accounts, cluster.account_qos, cluster.default_account = [], {}, None
    findings = login.check_account(profile(tmp_path, default_account=None), cluster)
    assert findings[0].level == "blocker" and "no Slurm association" in findings[0].detail
    cluster.enforces_associations = False
    assert login.check_account(profile(tmp_path, default_account=None), cluster)[0].level == "ok"


def test_a_controller_that_does_not_answer_is_named_not_every_partition(tmp_path, cluster):
    cluster.partitions, cluster.unread = {}, {"partitions": "slurm_load_partitions: Unable to contact slurm controller"}
    findings = login.login_checks(profile(tmp_path), cluster)
    assert [(f.check, f.level) for f in findings if f.level == "blocker"] == [("slurm", "blocker")]
    assert "controller does not answer" in findings[0].detail and "scontrol ping" in findings[0].fix


def test_slurm_missing_stops_the_cluster_checks(tmp_path):
    findings = login.login_checks(profile(tmp_path), Discovery(user="carol", unread={"slurm": "sinfo: not found"}))
    assert verdicts(findings)["slurm"] == "blocker" and "partition" not in verdicts(findings)
    assert "module load slurm" in findings[0].fix


@pytest.mark.parametrize(("variable", "value", "problem"), [
    ("NCCL_SOCKET_IFNAME", "eth", None), ("NCCL_SOCKET_IFNAME", "=eth0", None),
    ("NCCL_SOCKET_IFNAME", "^docker,lo", None), ("NCCL_SOCKET_IFNAME", "ens", "matches no device"),
    ("NCCL_SOCKET_IFNAME", "^eth,lo,mlx", "excludes every device"),
    ("NCCL_SOCKET_IFNAME", "=eth", "matches no device"), ("NCCL_IB_HCA", "mlx5_0:1,mlx5_1:1", None),
    ("NCCL_IB_HCA", "=mlx5_9", "matches no device"), ("NCCL_IB_HCA", "", None),
])
def test_nccl_interface_variables_follow_nccls_syntax(variable, value, problem):
    found = compute.interface_problem(variable, value, ["eth0", "lo", "mlx5_0", "mlx5_1"])
    assert (found is None) if problem is None else (problem in found and value in found)


def test_fabric_variables_that_match_nothing_here_block(monkeypatch):
    args = {"profile": "mine", "fabric": "efa"}
    findings = compute.check_fabric(args, {"NCCL_SOCKET_IFNAME": "nonexistent9", "FI_PROVIDER": "efa"})
    levels = [(f.level, f.detail.split()[0]) for f in findings]
    assert ("blocker", "NCCL_SOCKET_IFNAME=nonexistent9") in levels
    assert ("blocker", "FI_PROVIDER=efa") in levels  # this machine has no EFA device


def test_wandb_offline_needs_nothing_and_an_unreachable_server_is_a_warning():
    assert compute.check_wandb({"WANDB_MODE": "offline"})[0].level == "ok"
    with socket.socket() as closed:  # a loopback port nobody listens on: refused at once
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    finding = compute.check_wandb({"WANDB_BASE_URL": f"http://127.0.0.1:{port}"})[0]
    assert finding.level == "warn" and "offline" in finding.fix


def test_nodes_without_internet_are_never_made_to_probe_w_and_b(monkeypatch):
    """The lab's profile says its nodes reach nothing off the machine: no connection is tried (a
    public name would be looked up), and a recipe logging online is warned of."""
    def no_connection(*args, **kwargs):
        raise AssertionError(f"a connection was tried: {args}")

    monkeypatch.setattr(compute.socket, "create_connection", no_connection)
    finding = compute.check_wandb({}, internet=False)[0]
    assert finding.level == "warn" and "compute_internet: false" in finding.detail and "offline" in finding.fix
    from toolkit.cluster.profile import load_profile

    assert load_profile("lab").compute_internet is False


def test_a_check_that_fails_to_run_is_a_warning_and_the_others_still_run(tmp_path, monkeypatch):
    args = {"profile": "mine", "token": str(tmp_path / "none"), "token_value": "x", "fabric": "none",
            "gpus_per_node": 0, "cpu_workers": None, "s3_prefix": "", "s3_endpoint": "", "lab": False,
            "login_build": build_id()}
    monkeypatch.setenv("WANDB_BASE_URL", "http://w:99999")  # a port out of range: urlparse raises
    monkeypatch.delenv("WANDB_MODE", raising=False)
    findings = {f.check: f for f in compute.run_checks(args, "node1")}
    assert findings["wandb"].level == "warn" and "could not run" in findings["wandb"].detail
    assert findings["gpus"].level == "ok" and "no GPUs" in findings["gpus"].detail  # 0 GPUs asked: no CUDA needed
    assert findings["ft_version"].level == "ok" and findings["fabric"].level == "ok"


def test_a_training_library_whose_import_fails_unforeseen_is_a_blocker_naming_it(monkeypatch):
    """doctor/node.py's blind except: an import of the training stack failing in a way nobody foresaw
    (not an ImportError: a library's own start-up raising, as torch's does on a CUDA it cannot use) is
    the finding, never the check's own failure (narrowed to ImportError or OSError, this test fails:
    checked)."""
    import builtins

    class Unforeseen(Exception):
        pass

    real_import = builtins.__import__

    def importing(name, *args, **kwargs):
        if name == "peft":
            raise Unforeseen("peft's start-up broke in a way nobody foresaw")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", importing)
    (finding,) = compute.check_versions({"profile": "mine", "login_build": build_id()})
    assert (finding.level, finding.check) == ("blocker", "environment")
    assert finding.detail.startswith("peft does not import with ") and "nobody foresaw" in finding.detail
    assert finding.fix == "ft cluster prepare mine"


def test_the_shared_root_must_hold_the_login_nodes_token(tmp_path):
    token = tmp_path / "token-abc"
    token.write_text("token-abc")
    args = {"profile": "mine", "token": str(token), "token_value": "token-abc"}
    assert compute.check_shared(args, "node7")[0].level == "ok"
    assert (tmp_path / "token-abc.node7").read_text() == "node7"
    other = compute.check_shared(args | {"token": str(tmp_path / "elsewhere")}, "node7")[0]
    assert other.level == "blocker" and "not the same filesystem" in other.detail


def srun_output(stdout: str, stderr: str = "", code: int = 0) -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess(["srun"], code, stdout, stderr)


def test_preflight_output_is_read_per_node_and_merged(tmp_path):
    token = tmp_path / "token-x"
    (tmp_path / "token-x.n1").write_text("n1")
    ok_line = '{"check": "shared_root", "level": "ok", "detail": "fine", "fix": "", "where": "%s"}'
    stdout = "\n".join([f"0: FT-DOCTOR {ok_line % 'n1'}", "0: FT-DOCTOR-DONE n1 1.0",
                        f"1: FT-DOCTOR {ok_line % 'n2'}", "1: FT-DOCTOR-DONE n2 1.2",
                        "2: FT-DOCTOR-MISSING n3 ft", "3: FT-DOCTOR-MISSING n4 ft", "4: FT-DOCTOR-MISSING",
                        '5: FT-DOCTOR {"check": "x", "level": "odd", "detail": "d"', "6: garbage"])
    findings = preflight.read_reports(srun_output(stdout), profile(tmp_path), "/envs/py", token, nodes=4)
    assert not [f for f in findings if f.check == "x"]  # a line cut short is dropped, not a crash
    missing = [f for f in findings if f.check == "environment"]
    assert len(missing) == 1 and missing[0].where == "n3,n4" and "ft cluster prepare mine" in missing[0].fix
    unseen = [f for f in findings if f.check == "shared_root" and f.level == "blocker"]
    assert [f.where for f in unseen] == ["n2"]  # n2's answer file never reached the login node


@pytest.mark.parametrize(("stderr", "check", "level"), [
    ("srun: error: Unable to allocate resources: Invalid account or account/partition combination specified",
     "account", "blocker"),
    ("srun: error: Unable to allocate resources: invalid partition specified: gpux", "partition", "blocker"),
    ("srun: error: Unable to allocate resources: Requested nodes are busy\nsrun: Immediate allocation failed",
     "preflight", "warn"),
])
def test_slurms_refusal_of_the_preflight_is_named(tmp_path, stderr, check, level):
    findings = preflight.read_reports(srun_output("", stderr, 1), profile(tmp_path), "py", None, nodes=2)
    assert [(f.check, f.level) for f in findings] == [(check, level)]


def test_preflight_step_carries_the_profiles_placement_and_container(tmp_path):
    container = profile(tmp_path, environment="container", container_runtime="pyxis", container_image="nvcr.io#ft",
                        tiers={"standard": {"partition": "gpu", "qos": "high"}})
    argv = preflight.srun_argv(container, 2, 60, container.training_python("/login/py"), {"a": 1})
    assert {"--partition=gpu", "--qos=high", "--account=ml", "--container-image=nvcr.io#ft", "--immediate=60",
            "--chdir=/", "--gres=gpu:8"} <= set(argv)  # with its GPUs: a step without them may see none
    assert argv[-3:-1] == ["ft-doctor", "python3"]
    assert os.path.basename(argv[argv.index("bash")]) == "bash"


def test_doctor_says_in_one_line_whether_ft_uses_pyslurm_and_why_not(monkeypatch):
    """pyslurm builds against exactly one Slurm release (PyPI: 25.11 only); ft uses it only there.
    A stand-in module: no pyslurm builds here (this machine's Slurms are 22.05 and 24.11)."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "pyslurm", None)  # not installed
    assert "not installed" in login.check_backend("24.11.5").detail
    monkeypatch.setitem(sys.modules, "pyslurm", types.SimpleNamespace(__version__="25.11.0"))
    other = login.check_backend("24.11.5")
    assert other.level == "ok" and "built for Slurm 25.11; this cluster runs 24.11.5" in other.detail
    assert "through pyslurm" in login.check_backend("25.11.2").detail


def test_a_training_environment_of_another_ft_is_named_as_such(tmp_path):
    """An environment built by an ft from before a module moved imports toolkit, not what this ft's
    preflight runs: named as another ft, not as no ft at all."""
    stdout = "\n".join(["0: FT-DOCTOR-MISSING n1 other-ft", "1: FT-DOCTOR-MISSING n2 ft"])
    findings = preflight.read_reports(srun_output(stdout), profile(tmp_path), "/envs/py", None, nodes=2)
    details = {f.where: f.detail for f in findings if f.check == "environment"}
    assert "holds another ft" in details["n1"] and "ft does not import" in details["n2"]
    assert preflight.WRAPPER.index("'import toolkit'") < preflight.WRAPPER.index("'import toolkit.doctor.node'")
