"""ft.cluster.slurm_limits's plan: what sacctmgr must set for the inventory's tiers and quotas, from
what slurmdbd holds (sacctmgr's --parsable2 answers as the lab's Slurm 22.05 prints them). The module
run for real against the lab's slurmdbd is tests/lab/test_provisioning.py's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

MODULE = (Path(__file__).parents[2] / "ansible/collections/ansible_collections/ft/cluster/plugins/modules"
          / "slurm_limits.py")
spec = importlib.util.spec_from_file_location("slurm_limits", MODULE)
limits = importlib.util.module_from_spec(spec)
spec.loader.exec_module(limits)

QOS = "normal|0\nft-free|0\nft-standard|100\nft-premium|1000\n"
ASSOCIATIONS = """root||ft-free,ft-premium,ft-standard,normal||
root|root|normal||
research||normal||
capped||normal|gres/gpu=0|1
capped|root|normal||
"""
TIERS = [{"name": "ft-free", "priority": 0}, {"name": "ft-standard", "priority": 100},
         {"name": "ft-premium", "priority": 1000}]
ACCOUNTS = [{"name": "research"}, {"name": "capped", "cap_gpu_hours": 0.01, "max_running_jobs": 1}]  # 0.6 min


def plan(qos=QOS, associations=ASSOCIATIONS, tiers=TIERS, accounts=ACCOUNTS):
    return limits.plan("lab", limits.parse_qos(qos), limits.parse_accounts(associations),
                       *limits.checked(tiers, accounts))


def test_a_cluster_as_the_inventory_says_needs_nothing():
    assert plan() == []


def test_each_difference_is_one_sacctmgr_call():
    drifted = ASSOCIATIONS.replace("gres/gpu=0|1", "gres/gpu=600|1")  # a cap raised by hand
    ((what, argv),) = plan(associations=drifted)
    assert what == "account capped: GPU-minutes cap 600 -> 0, running jobs 1 -> 1"  # 0.6 min, never looser
    assert argv[-2:] == ["GrpTRESMins=gres/gpu=0", "GrpJobs=1"] and "cluster=lab" in argv
    changes = plan(qos=QOS.replace("ft-premium|1000", "ft-premium|5").replace("ft-free|0\n", ""))
    assert [what for what, _ in changes] == ["create QOS ft-free (priority 0)", "QOS ft-premium: priority 5 -> 1000"]
    root = plan(associations=ASSOCIATIONS.replace("root||ft-free,ft-premium,ft-standard,normal", "root||normal,site"))
    assert root[0][1][-1] == "qos+=ft-free,ft-premium,ft-standard"  # added: the site's own QOS stays
    assert plan(associations=ASSOCIATIONS.replace("root||ft-free", "root||site,ft-free")) == []


def test_a_cap_or_limit_taken_out_of_the_inventory_is_cleared_and_zero_is_a_limit():
    ((_, argv),) = plan(accounts=[{"name": "research"}, {"name": "capped"}])
    assert argv[-2:] == ["GrpTRESMins=gres/gpu=-1", "GrpJobs=-1"]
    ((_, argv),) = plan(accounts=[{"name": "research", "max_running_jobs": 0, "cap_gpu_hours": 0},
                                  ACCOUNTS[1]])
    assert argv[-2:] == ["GrpTRESMins=gres/gpu=0", "GrpJobs=0"]  # nothing may run: not "no limit"


@pytest.mark.parametrize("tiers,accounts,message", [
    ([{"name": "ft-free,normal", "priority": 0}], [], "QOS name"),
    ([{"name": "ft-free", "priority": "high"}], [], "priority 'high' is not a number"),
    ([{"name": "ft-free", "priority": 2.5}], [], "whole number"),
    ([], [{"name": "capped,research"}], "account name"),
    ([], [{"name": "a=b"}], "account name"),
    ([], [{"name": "capped", "cap_gpu_hours": -1}], "0 or more"),
    ([], [{"name": "capped", "cap_gpu_hours": float("nan")}], "0 or more"),
    ([], [{"name": "capped", "cap_gpu_hours": "abc"}], "not a number"),
])
def test_what_sacctmgr_would_misread_fails_before_anything_is_set(tiers, accounts, message):
    with pytest.raises(limits.Invalid, match=message):
        limits.checked(tiers, accounts)


def test_names_are_slurmdbds_lowercase_and_numbers_compare_as_numbers():
    tiers, accounts = limits.checked([{"name": "FT-Premium", "priority": "1000"}, {"name": "ft-free", "priority": 0.0}],
                                     [{"name": "Capped", "cap_gpu_hours": "0.01", "max_running_jobs": 1.0}])
    assert tiers == [{"name": "ft-premium", "priority": "1000"}, {"name": "ft-free", "priority": "0"}]
    assert accounts == [{"name": "capped", "cap_minutes": "0", "max_running_jobs": "1"}]
    assert plan(tiers=[{"name": "FT-Premium", "priority": 1000.0}], accounts=[]) == []  # nothing to do


def test_the_diff_shows_the_state_before_and_after():
    qos, accounts = limits.parse_qos(QOS), limits.parse_accounts(ASSOCIATIONS.replace("gres/gpu=0|1", "|"))
    after = limits.wanted_state(qos, accounts, *limits.checked(TIERS, ACCOUNTS))
    before_text = limits.describe(qos, accounts, ["capped"])
    after_text = limits.describe(*after, ["capped"])
    assert "account capped: GrpTRESMins=gres/gpu=none GrpJobs=none" in before_text
    assert "account capped: GrpTRESMins=gres/gpu=0 GrpJobs=1" in after_text
