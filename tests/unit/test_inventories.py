"""One set of templates serves every inventory: render each site's configuration and check that
it says what that site needs (rendered locally; no host of a real cluster is contacted)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from toolkit.lab.provision import ansible_dir, run_playbook

SITES = ["lab", "hyperpod", "coreweave", "oci"]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for site in SITES:
        folder = tmp_path_factory.mktemp(site)
        result = run_playbook("render-config.yml", {"render_dir": str(folder)},
                              inventory=str(ansible_dir() / "inventories" / site))
        assert result.ok, f"{site}: {result.error}"
        out[site] = folder
    return out


def conf(folder: Path, name: str = "slurm.conf") -> dict[str, list[str]]:
    """Key -> values of a Slurm config file (keys may repeat: NodeName, PartitionName)."""
    entries: dict[str, list[str]] = {}
    for line in (folder / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            entries.setdefault(key, []).append(value)
    return entries


@pytest.mark.parametrize("site", SITES)
def test_every_site_gets_the_shared_essentials(rendered, site):
    slurm = conf(rendered[site])
    assert slurm["SelectType"] == ["select/cons_tres"]
    assert slurm["GresTypes"] == ["gpu"]
    assert slurm["JobRequeue"] == ["1"]
    assert slurm["PreemptMode"] == ["REQUEUE"]
    assert slurm["HealthCheckProgram"] == ["/usr/local/sbin/ft-healthcheck"]
    # The same checks gate every job at allocation; a failed gate requeues the job, not held.
    assert slurm["Prolog"] == ["/usr/local/sbin/ft-healthcheck"] and slurm["PrologFlags"] == ["Alloc"]
    assert slurm["PrologEpilogTimeout"] == ["120"]
    env = subprocess.run(["bash", "-c", f"set -a; . {rendered[site] / 'healthcheck.env'}; env"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert "FT_HC_PYTHON=/usr/bin/python3" in env and "FT_HC_LIB=/usr/local/lib/ft-health" in env
    assert "nohold_on_prolog_fail" in slurm["SchedulerParameters"][0].split(",")
    assert slurm["AccountingStorageType"] == ["accounting_storage/slurmdbd"]
    assert "gres/gpu" in slurm["AccountingStorageTRES"][0]
    dbd = conf(rendered[site], "slurmdbd.conf")
    assert dbd["StorageType"] == ["accounting_storage/mysql"]
    assert "StoragePass" not in dbd  # socket authentication: no database password anywhere
    assert (rendered[site] / "slurmdbd.conf").stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("site", SITES)
def test_tiers_map_to_partitions_that_exist(rendered, site):
    profile = yaml.safe_load((rendered[site] / "cluster.yaml").read_text())
    partitions = {re.match(r"(\S+)", value)[1] for value in conf(rendered[site])["PartitionName"]}
    assert set(profile["tiers"]) == {"free", "standard", "premium"}
    for tier, target in profile["tiers"].items():
        assert target["partition"] in partitions, f"{site}: tier {tier} names a missing partition"
    # free < standard < premium, and only lower tiers are requeued on preemption.
    lines = {re.match(r"(\S+)", v)[1]: v for v in conf(rendered[site])["PartitionName"]}
    tier_of = {t: int(re.search(r"PriorityTier=(\d+)", lines[profile["tiers"][t]["partition"]])[1])
               for t in profile["tiers"]}
    assert tier_of["free"] < tier_of["standard"] < tier_of["premium"]
    assert "PreemptMode=REQUEUE" in lines[profile["tiers"]["free"]["partition"]]


@pytest.mark.parametrize("site,fabric,variable", [
    ("hyperpod", "efa", "FI_PROVIDER"),
    ("coreweave", "infiniband", "NCCL_IB_HCA"),
    ("oci", "roce", "NCCL_IB_GID_INDEX"),
])
def test_gpu_sites_autodetect_gpus_and_carry_their_fabric(rendered, site, fabric, variable):
    gres = conf(rendered[site], "gres.conf")
    assert gres["AutoDetect"] == ["nvml"]
    node_lines = conf(rendered[site])["NodeName"]
    assert all("Gres=gpu:h100:8" in line for line in node_lines)
    profile = yaml.safe_load((rendered[site] / "cluster.yaml").read_text())
    assert profile["fabric"] == fabric
    assert variable in profile["nccl_env"]
    assert profile["gpus_per_node"] == 8
    assert profile["shared_root"].startswith("/")
    slurm = conf(rendered[site])
    assert slurm["SlurmdTimeout"] == ["300"]  # production cadence, not the lab's


def test_only_hyperpod_asks_for_auto_resume(rendered):
    extras = {site: yaml.safe_load((rendered[site] / "cluster.yaml").read_text())["srun_extra_args"]
              for site in SITES}
    assert extras["hyperpod"] == ["--auto-resume=1"]
    assert all(not args for site, args in extras.items() if site != "hyperpod")


def test_lab_lists_fake_gpu_devices_per_node_and_fast_failure_detection(rendered):
    gres = (rendered["lab"] / "gres.conf").read_text()
    assert "AutoDetect" not in gres
    assert "NodeName=node1 Name=gpu File=/var/lib/ft-lab/dev/node1/nvidia[0-3]" in gres
    slurm = conf(rendered["lab"])
    assert slurm["SlurmdTimeout"] == ["10"]
    assert slurm["AuthInfo"] == ["cred_expire=10"]
    assert slurm["SchedulerParameters"] == ["sched_interval=2,bf_interval=2,nohold_on_prolog_fail"]
    assert any("NodeAddr=10.213.7.11" in line for line in slurm["NodeName"])
