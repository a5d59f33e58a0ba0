"""The broker on the real lab (toolkit/cluster/broker.py): two profiles of the lab that differ only in
price (the lab's own, priced, and `dear`), each submitting to its own slice's partitions. Slurm's
own `sbatch --test-only` says when a job would start on each; `ft plan` takes the cheaper, and the
sooner one once the cheaper slice is full; `ft submit --cluster auto` submits there and records why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.support.slurm import cancel, job_fields, sbatch, wait_for, write_script
from tests.support.training import TINY, ft

pytestmark = [pytest.mark.whole_lab, pytest.mark.slurm_matrix]  # it fills one slice and submits to the other


@pytest.fixture
def priced(whole_lab, tmp_path, monkeypatch):
    if len(whole_lab.slices) < 2:
        pytest.skip("the lab has one slice: `ft lab up --slices 2`")
    first, second = whole_lab.slice(1), whole_lab.slice(2)
    clusters = tmp_path / "clusters.yaml"
    clusters.write_text(yaml.safe_dump({
        # The lab's own profile, priced (it has no price of its own: it would be the cheapest of all).
        "lab": {"extends": "lab", "price_per_gpu_hour": 1.0,
                  "tiers": {tier: {"partition": partition} for tier, partition in first.tiers.items()}},
        "dear": {"extends": "lab", "price_per_gpu_hour": 3.0,
                 "tiers": {tier: {"partition": partition} for tier, partition in second.tiers.items()}}}))
    monkeypatch.setenv("FT_CLUSTERS_FILE", str(clusters))
    return first, second


def plan() -> dict:
    shown = ft("plan", str(TINY), "--json")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def test_the_cheaper_lab_then_the_sooner_when_the_cheaper_is_full(priced, tmp_path):
    first, second = priced
    chosen = plan()["chosen"]
    assert chosen["cluster"] == "lab" and chosen["start"] is not None
    # The cheap slice full for an hour, in its premium partition (which nothing preempts).
    script = write_script(tmp_path / "fill.sh", "sleep 3600\n")
    filler = sbatch(script, f"--partition={first.tiers['premium']}", f"--nodes={len(first.nodes)}",
                    "--time=60", f"--output={tmp_path}/fill-%j.out")
    submitted = None
    try:
        wait_for("the filler to run", lambda: job_fields(filler).get("JobState") == "RUNNING", timeout=60)
        planned = plan()
        cheap = [o for o in planned["options"] if o["cluster"] == "lab" and o["fits"]]
        assert cheap and all(o["start"] - planned["chosen"]["start"] > 1800 for o in cheap)  # after the filler
        assert planned["chosen"]["cluster"] == "dear" and "would not start before" in planned["why"]
        runs = tmp_path / "runs"
        done = ft("submit", str(TINY), "--cluster", "auto", "--json", runs_dir=runs)
        assert done.returncode == 0, done.stderr
        submitted = json.loads(done.stdout)
        assert submitted["plan"]["chosen"]["cluster"] == "dear"
        recorded = json.loads((Path(submitted["run_dir"]) / "plan.json").read_text())
        assert recorded["chosen"]["cluster"] == "dear" and recorded["why"] == submitted["plan"]["why"]
        assert job_fields(submitted["job_id"]).get("Partition") in set(second.tiers.values())
    finally:
        cancel(filler, *([submitted["job_id"]] if submitted else []))
