"""Quotas on the real lab (ansible/roles/slurm_accounting, from the lab's inventory): the account
`capped` has no GPU-hours left this month. ft refuses a run charged to it, naming what is left and
submitting nothing; Slurm itself holds a plain sbatch from the same account (AssocGrp*: GrpTRESMins
with AccountingStorageEnforce=safe), so a power user's own script cannot go round the cap. The
service tiers are QOS every account may use."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.support.slurm import cancel, job_fields, sbatch, wait_for, write_script
from tests.support.training import ft, tiny_recipe


@pytest.mark.slurm_matrix
def test_a_capped_account_is_refused_by_ft_and_held_by_slurm(lab, tmp_path):
    recipe = tiny_recipe()
    recipe["resources"]["account"] = "capped"
    capped = tmp_path / "capped.yaml"
    capped.write_text(yaml.safe_dump(recipe))
    runs = tmp_path / "runs"
    refused = ft("submit", str(capped), runs_dir=runs)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "account capped has used" in refused.stderr and "nothing was submitted" in refused.stderr
    assert not runs.exists() or not any(runs.iterdir())  # no run folder, no job
    script = write_script(tmp_path / "by-hand.sh", "sleep 30\n")
    job = sbatch(script, "--account=capped", "--gres=gpu:1", "--time=5", f"--output={tmp_path}/by-hand-%j.out")
    def held() -> str | None:
        fields = job_fields(job)
        assert fields.get("JobState") == "PENDING", fields  # never started
        return fields["Reason"] if fields.get("Reason") not in (None, "None", "Priority", "Resources") else None

    try:
        reason = wait_for("Slurm to say why it holds the job", held, timeout=60, interval=1)
        assert reason.startswith("AssocGrp"), reason
    finally:
        cancel(job)


def test_the_tiers_are_qos_by_priority_that_every_account_may_use():
    listed = subprocess.run(["sacctmgr", "--noheader", "--parsable2", "show", "qos", "format=name,priority"],
                            capture_output=True, text=True, check=True).stdout
    priorities = dict(line.split("|") for line in listed.splitlines())
    assert int(priorities["ft-free"]) < int(priorities["ft-standard"]) < int(priorities["ft-premium"])
    root = subprocess.run(["sacctmgr", "--noheader", "--parsable2", "show", "associations", "account=root", "user=",
                           "format=qos"], capture_output=True, text=True, check=True).stdout
    assert {"ft-free", "ft-standard", "ft-premium"} <= set(root.strip().split(","))
    config = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True).stdout
    assert "priority/multifactor" in config and "safe" in config
