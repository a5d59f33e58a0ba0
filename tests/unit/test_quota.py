"""An account's quota before a submit (toolkit/account/quota.py): refused past its cap, warned past its
budget and at its limit of runs at once; Slurm's answers as the lab's Slurm 22.05 gives them."""

# ruff: noqa: E501 - sacct's lines below are kept as Slurm prints them

from __future__ import annotations

import json
import os
from datetime import datetime

import pytest

from tests.support.run_specs import run_spec
from tests.support.sacct import sacct_json
from toolkit.account import quota
from toolkit.cluster.profile import load_profile
from toolkit.recipe.resolve import ResolvedRecipe
from toolkit.slurm.commands import CommandResult
from toolkit.slurm.site import AccountQuota

NOW = datetime(2026, 11, 24, 12, 0, 0).timestamp()
# This month: a run of ft's and a hand-made job of account physics (Slurm counts both), one of research.
SACCT = """11|ft-r1|alice|physics|standard|ft-standard|COMPLETED|3600|billing=2,cpu=2,gres/gpu=2,mem=8G,node=2|2026-11-03T10:00:00|2026-11-03T11:00:00|2026-11-03T10:00:00
12|by-hand|bob|physics|free|normal|COMPLETED|1800|billing=4,cpu=4,gres/gpu=4,node=1|2026-11-04T10:00:00|2026-11-04T10:30:00|2026-11-04T10:00:00
13|ft-r2|carol|research|standard|ft-standard|COMPLETED|36000|billing=8,cpu=8,gres/gpu=8,node=1|2026-11-05T10:00:00|2026-11-05T20:00:00|2026-11-05T10:00:00
"""


# scontrol show assoc_mgr flags=assoc accounts=physics, as the lab's Slurm 22.05 prints it: the
# account's record (Slurm's count of its GPU-minutes: {used} used, {left} its running jobs may still use),
# then a user's of it.
ASSOC_MGR = """Current Association Manager state

Association Records

ClusterName=lab Account=physics UserName= Partition= Priority=0 ID=5
    SharesRaw/Norm/Level/Factor=1/0.25/4/0.00
    UsageRaw/Norm/Efctv=0.00/0.00/0.00
    ParentAccount=root(1) Lft=2 DefAssoc=No
    GrpJobs=1(0) GrpJobsAccrue=N(0)
    GrpSubmitJobs=N(0) GrpWall=N(0.00)
    GrpTRES=cpu=N(0),mem=N(0),energy=N(0),node=N(0),billing=N(0),fs/disk=N(0),vmem=N(0),pages=N(0),gres/gpu=N(0)
    GrpTRESMins=cpu=N(0),mem=N(0),energy=N(0),node=N(0),billing=N(0),fs/disk=N(0),vmem=N(0),pages=N(0),gres/gpu=600({used})
    GrpTRESRunMins=cpu=N(0),mem=N(0),energy=N(0),node=N(0),billing=N(0),fs/disk=N(0),vmem=N(0),pages=N(0),gres/gpu=N({left})
    MaxJobs= MaxJobsAccrue= MaxSubmitJobs= MaxWallPJ=
ClusterName=lab Account=physics UserName=alice(1001) Partition= Priority=0 ID=10
    GrpTRESMins=cpu=N(0),mem=N(0),energy=N(0),node=N(0),billing=N(0),fs/disk=N(0),vmem=N(0),pages=N(0),gres/gpu=N(9999)
    GrpTRESRunMins=cpu=N(0),mem=N(0),energy=N(0),node=N(0),billing=N(0),fs/disk=N(0),vmem=N(0),pages=N(0),gres/gpu=N(9999)
"""


def slurm(running: int = 0, queued: list[dict] = (), assoc_mgr: str | None = None, private: bool = False):
    jobs = [*queued, *({"account": "physics", "job_state": "RUNNING", "tres_req_str": "cpu=1", "end_time": NOW}
                       for _ in range(running))]  # running jobs with no GPU-hours left to use

    def run(argv, timeout=None, check=True):
        if argv[0] == "sacct":
            assert "--json" in argv
            return CommandResult(tuple(argv), 0, sacct_json(SACCT), "")
        if argv[0] == "squeue":
            assert "--json" in argv
            return CommandResult(tuple(argv), 0, json.dumps({"jobs": jobs}), "")
        if argv[:3] == ["scontrol", "show", "assoc_mgr"]:
            return CommandResult(tuple(argv), 0, assoc_mgr or "Current Association Manager state\n", "")
        if argv[:3] == ["scontrol", "show", "config"]:
            return CommandResult(tuple(argv), 0, f"PrivateData             = {'jobs' if private else 'none'}\n", "")
        return CommandResult(tuple(argv), 0, "physics\n", "")  # sacctmgr: the user's default account
    return run


def resolved(account: str | None, accounts: dict, time: str = "01:00:00", gpus: int = 2) -> ResolvedRecipe:
    spec = run_spec()
    data = spec.recipe.model_dump(mode="json")
    recipe = spec.recipe.model_validate(data | {"resources": data["resources"] | {
        "account": account, "time": time, "gpus_per_node": gpus}})
    profile = load_profile("lab").model_copy(update={"accounts": accounts, "default_account": None})
    return ResolvedRecipe(recipe=recipe, profile=profile, path=None, derived=spec.derived)


def test_a_run_past_the_cap_is_refused_and_says_what_is_left():
    # physics used 2 x 1 h + 4 x 0.5 h = 4 GPU-hours; a 2-GPU run of 1 h asks 2 more.
    with pytest.raises(quota.QuotaExceeded, match=r"account physics has used 4.00 of its 5 GPU-hours .* up to 2.00") as refused:
        quota.check(resolved("physics", {"physics": AccountQuota(cap_gpu_hours=5)}), slurm(), now=NOW)
    assert refused.value.exit_code == 2 and "resources.time" in refused.value.hint
    assert quota.check(resolved("physics", {"physics": AccountQuota(cap_gpu_hours=6)}), slurm(), now=NOW) == []


def test_what_runs_and_waits_counts_up_to_its_time_limit():
    """Slurm holds back what the account's running and pending jobs may still use: so does ft."""
    queued = [{"account": "physics", "job_state": "RUNNING", "tres_req_str": "cpu=2,node=1,gres/gpu=2",
               "time_limit": 60, "end_time": NOW + 1800},  # 2 GPUs x 30 min left
              {"account": "physics", "job_state": "PENDING", "tres_req_str": "cpu=1,gres/gpu=1", "time_limit": 60},
              {"account": "research", "job_state": "PENDING", "tres_req_str": "gres/gpu=8", "time_limit": 600}]
    running_left, pending, running = quota.queued("physics", slurm(queued=queued), now=NOW)
    assert running_left == pytest.approx(1.0) and pending == pytest.approx(1.0) and running == 1
    with pytest.raises(quota.QuotaExceeded, match=r"has used 6.00 of its 7 GPU-hours"):
        quota.check(resolved("physics", {"physics": AccountQuota(cap_gpu_hours=7)}), slurm(queued=queued), now=NOW)


def test_an_account_named_in_capitals_is_slurms_lowercase_one():
    with pytest.raises(quota.QuotaExceeded, match="account physics"):
        quota.check(resolved("PHYSICS", {"physics": AccountQuota(cap_gpu_hours=5)}), slurm(), now=NOW)


def test_spare_nodes_count_in_what_a_run_may_use():
    spec = resolved("physics", {"physics": AccountQuota(cap_gpu_hours=7)})  # 4 used; 2 more fit, 4 do not
    spared = spec.recipe.resources.model_copy(update={"spare_nodes": 1})
    spec.recipe = spec.recipe.model_copy(update={"resources": spared})
    with pytest.raises(quota.QuotaExceeded, match=r"up to 4.00 more \(4 GPUs"):  # (1 + 1 spare) x 2 GPUs x 1 h
        quota.check(spec, slurm(), now=NOW)


def test_the_users_default_account_is_the_one_charged_and_budgets_and_limits_warn():
    warnings = quota.check(resolved(None, {"physics": AccountQuota(budget_gpu_hours=5, max_running_jobs=3)}),
                           slurm(running=3), now=NOW)
    assert len(warnings) == 2
    assert "passes its monthly budget: 4.00 of 5 GPU-hours" in warnings[0]
    assert "3 jobs running, its limit" in warnings[1]


def test_an_account_without_a_quota_or_without_accounting_is_not_checked():
    assert quota.check(resolved("research", {"physics": AccountQuota(cap_gpu_hours=0)}), slurm(), now=NOW) == []

    def silent(argv, timeout=None, check=True):
        from toolkit.slurm.commands import SlurmUnavailable
        raise SlurmUnavailable("accounting storage is disabled")

    assert quota.check(resolved("physics", {"physics": AccountQuota(cap_gpu_hours=0)}), silent, now=NOW) == []


def test_slurms_own_count_is_met_where_it_is_more_than_ft_sees(monkeypatch):
    """Slurm enforces the cap on its association manager's count (of jobs ft's sacct query may not see:
    another user's private ones): ft refuses on the larger of the two."""
    counted = slurm(assoc_mgr=ASSOC_MGR.format(used=360, left=60))  # 6 h used, 1 h more may be
    assert quota.slurms_count("physics", counted) == (6.0, 1.0)  # the account's own record, not alice's
    with pytest.raises(quota.QuotaExceeded, match=r"has used 7.00 of its 8 GPU-hours"):
        quota.check(resolved("physics", {"physics": AccountQuota(cap_gpu_hours=8)}), counted, now=NOW)
    # Slurm counts less (it tallies every few minutes): ft's own sum, 4 GPU-hours, stands.
    assert quota.check(resolved("physics", {"physics": AccountQuota(cap_gpu_hours=6)}),
                       slurm(assoc_mgr=ASSOC_MGR.format(used=0, left=0)), now=NOW) == []


def test_where_slurm_hides_other_users_jobs_the_submit_says_its_count_may_be_short(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    (warning,) = quota.check(resolved("physics", {"physics": AccountQuota(cap_gpu_hours=100)}),
                             slurm(private=True), now=NOW)
    assert "private on this cluster (PrivateData)" in warning and "may be only yours" in warning
    shown = slurm(private=True, assoc_mgr=ASSOC_MGR.format(used=0, left=0))  # Slurm's count shown: no doubt
    assert quota.check(resolved("physics", {"physics": AccountQuota(cap_gpu_hours=100)}), shown, now=NOW) == []
