"""The broker (toolkit/cluster/broker.py): every profile and tier that fits a recipe, with Slurm's
word on its start where this host's Slurm has the partition (sbatch --test-only, answered here as
the lab's Slurm 22.05 answers it), and the choice `ft submit --cluster auto` makes."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

import pytest
import yaml

from toolkit.base.errors import FtError
from toolkit.cluster import broker
from toolkit.cluster.profile import load_all
from toolkit.slurm.commands import CommandResult

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny-lora-sft.yaml"
NOW = datetime(2026, 11, 24, 12, 0, 0).timestamp()


def at(minutes: float) -> str:
    return datetime.fromtimestamp(NOW + minutes * 60).strftime("%Y-%m-%dT%H:%M:%S")


def slurm(starts: dict[str, str | None]):
    """sinfo and sbatch --test-only answering for partitions `starts` names: a start time, or (None) a refusal."""
    asked = []

    def run(argv, timeout=None, check=True):
        if argv[0] == "sinfo":
            return CommandResult(tuple(argv), 0, "\n".join(starts) + "\n", "")
        if argv[0] == "scontrol":
            return CommandResult(tuple(argv), 0, "Configuration data as of 2026-11-24T12:00:00\n"
                                                 "ClusterName             = lab\n", "")
        script = Path(argv[-1]).read_text()
        partition = next(line.split("=", 1)[1] for line in script.splitlines()
                         if line.startswith("#SBATCH --partition="))
        asked.append(partition)
        if starts[partition] is None:
            return CommandResult(tuple(argv), 1, "", "sbatch: error: Requested time limit is invalid "
                                                     "(missing or exceeds some limit)\n")
        return CommandResult(tuple(argv), 0, "", f"sbatch: Job 7 to start at {starts[partition]} using 2 processors on "
                                                 f"nodes node[1-2] in partition {partition}\n")
    return run, asked


@pytest.fixture
def two_priced_labs(tmp_path, monkeypatch):
    """Two profiles of the lab that differ only in price and in the partitions they submit to."""
    clusters = tmp_path / "clusters.yaml"
    clusters.write_text(yaml.safe_dump({
        "cheap": {"extends": "lab", "price_per_gpu_hour": 1.0},
        "dear": {"extends": "lab", "price_per_gpu_hour": 3.0, "tiers": {
            "free": {"partition": "s2-free"}, "standard": {"partition": "s2-standard"},
            "premium": {"partition": "s2-premium"}}},
        # Another cluster whose partitions happen to bear the lab's names: this Slurm cannot speak for it.
        "far": {"extends": "hyperpod", "price_per_gpu_hour": 0.5, "tiers": {
            "free": {"partition": "free"}, "standard": {"partition": "standard"},
            "premium": {"partition": "premium"}}}}))
    monkeypatch.setenv("FT_CLUSTERS_FILE", str(clusters))
    monkeypatch.setenv("FT_SITE_PROFILE", str(tmp_path / "no-site.yaml"))
    profiles, errors = load_all()
    assert not errors
    return {name: profiles[name] for name in ("cheap", "dear", "far", "hyperpod")}


def test_the_cheaper_of_two_that_start_now_and_the_sooner_when_the_cheaper_is_full(two_priced_labs):
    run, asked = slurm({"free": at(0), "standard": at(0), "premium": at(0),
                        "s2-free": at(0), "s2-standard": at(0), "s2-premium": at(0)})
    found = broker.options(TINY, two_priced_labs, run)
    assert sorted(asked) == sorted(["free", "standard", "premium", "s2-free", "s2-standard", "s2-premium"])
    elsewhere = [o for o in found if o.cluster in ("hyperpod", "far")]
    assert len(elsewhere) == 6 and all(o.start is None and "not this host's Slurm" in o.why for o in elsewhere)
    best, why = broker.choose(found, now=NOW)
    assert (best.cluster, best.tier) == ("cheap", "standard") and "cheapest" in why  # among equals, the recipe's tier
    assert best.cost == pytest.approx(best.gpus * best.hours * 1.0)
    # The cheap lab's partitions are full for four hours: the dear one starts now.
    run, _ = slurm({"free": at(240), "standard": at(240), "premium": at(240),
                    "s2-free": at(0), "s2-standard": at(0), "s2-premium": at(0)})
    best, why = broker.choose(broker.options(TINY, two_priced_labs, run), now=NOW)
    assert best.cluster == "dear" and "cheap/" in why and "would not start before" in why
    soonest, _ = broker.choose(broker.options(TINY, two_priced_labs, run), prefer="soonest", now=NOW)
    assert soonest.cluster == "dear"


def test_a_tier_of_its_own_price_is_weighed_at_it(two_priced_labs):
    cheap = two_priced_labs["cheap"]
    tiers = dict(cheap.tiers, free=cheap.tiers["free"].model_copy(update={"price_per_gpu_hour": 0.5}))
    two_priced_labs["cheap"] = cheap.model_copy(update={"tiers": tiers})
    run, _ = slurm({"free": at(10), "standard": at(0), "premium": at(0),
                    "s2-free": at(0), "s2-standard": at(0), "s2-premium": at(0)})
    found = broker.options(TINY, two_priced_labs, run)
    free = next(o for o in found if (o.cluster, o.tier) == ("cheap", "free"))
    assert free.price == 0.5 and free.cost == pytest.approx(free.gpus * free.hours * 0.5)
    assert broker.choose(found, now=NOW)[0] is free  # half the price, and it starts within the wait
    assert broker.choose(found, max_wait_s=300, now=NOW)[0].tier == "standard"  # not within 5 minutes


def test_among_equal_costs_the_recipes_own_tier_even_if_another_starts_sooner(two_priced_labs):
    run, _ = slurm({"free": at(0), "standard": at(12), "premium": at(0),
                    "s2-free": at(0), "s2-standard": at(0), "s2-premium": at(0)})
    best, why = broker.choose(broker.options(TINY, two_priced_labs, run), now=NOW)
    assert (best.cluster, best.tier) == ("cheap", "standard") and "not the recipe's" not in why


def test_a_start_slurm_cannot_tell_yet_still_fits():
    def run(argv, timeout=None, check=True):
        return CommandResult(tuple(argv), 0, "", "sbatch: Job 9 to start at Unknown using 2 processors on nodes "
                                                 "node[1-2] in partition standard\n")
    assert broker.expected_start("#!/bin/bash\n", run) == (None, "Slurm accepts it, with no start time yet")


def test_what_slurm_refuses_does_not_fit_and_says_why(two_priced_labs):
    run, _ = slurm({"free": None, "standard": None, "premium": None,
                    "s2-free": None, "s2-standard": at(5), "s2-premium": None})
    found = broker.options(TINY, two_priced_labs, run)
    refused = [o for o in found if not o.fits]
    assert refused and all("time limit is invalid" in o.why for o in refused if o.cluster not in ("hyperpod", "far"))
    best, _ = broker.choose(found, now=NOW)
    assert (best.cluster, best.tier) == ("dear", "standard")
    run, _ = slurm({name: None for name in ("free", "standard", "premium", "s2-free", "s2-standard", "s2-premium")})
    with pytest.raises(FtError, match="no cluster profile and tier"):
        broker.choose(broker.options(TINY, two_priced_labs, run), now=NOW)


def test_a_recipe_that_does_not_load_is_one_located_error_not_every_profiles_misfit(two_priced_labs, tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: r\nmodel: [\n")
    run, asked = slurm({"standard": at(0)})
    with pytest.raises(FtError, match="broken.yaml"):
        broker.options(broken, two_priced_labs, run)
    with pytest.raises(FtError, match="nope.yaml"):
        broker.options(tmp_path / "nope.yaml", two_priced_labs, run)
    assert asked == []  # nothing asked of Slurm
