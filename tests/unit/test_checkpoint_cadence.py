"""`checkpoint.every_minutes: auto`: Young/Daly's interval from the save cost and the failure rate,
never below the background write, the run's own faults counted when they are worse than the prior,
shown by `ft recipe explain`."""

from __future__ import annotations

import math

import pytest

from toolkit.checkpoint.cadence import FIRST_INTERVAL_S, MIN_INTERVAL_S, AutoCadence, Cadence, daly_interval_s
from toolkit.cluster.profile import load_profile
from toolkit.recipe.resolve import derive
from toolkit.recipe.schema import Recipe


def test_daly_is_youngs_square_root_for_cheap_saves_and_the_mtbf_for_dear_ones():
    day = 86400.0
    assert daly_interval_s(1.0, day) == pytest.approx(math.sqrt(2 * day), rel=0.01)
    assert daly_interval_s(60.0, day) < math.sqrt(2 * 60 * day)  # the higher-order terms minus C
    assert daly_interval_s(60.0, day) > daly_interval_s(10.0, day) > daly_interval_s(10.0, day / 10)
    assert daly_interval_s(day, day) == day and daly_interval_s(0, day) == 0


def test_the_interval_never_undercuts_the_write_nor_a_minute_and_waits_for_a_first_measure():
    cadence = AutoCadence(job_mtbf_hours=100)
    assert cadence.interval_s(None, 0) == FIRST_INTERVAL_S
    assert cadence.interval_s(0.01, write_s=120) == 120  # a 10 ms snapshot would ask for a save every ~85 s
    assert "the background write's time" in cadence.describe(0.01, write_s=120)
    assert cadence.interval_s(0.0, write_s=0) == MIN_INTERVAL_S == cadence.interval_s(-1, write_s=0)


def test_the_runs_own_faults_move_the_estimate_without_collapsing_it():
    cadence = AutoCadence(job_mtbf_hours=100)
    assert cadence.mtbf_s()[0] == 100 * 3600
    one_early = cadence.mtbf_s(faults=1, observed_s=120)[0]
    assert one_early == (100 * 3600 + 120) / 2  # one fault two minutes in halves it, no more
    assert cadence.mtbf_s(faults=40, observed_s=2 * 3600)[0] < 3 * 3600  # many faults: the run's own rate
    assert "this run's 40 fault(s) in 2.00 h" in cadence.mtbf_s(faults=40, observed_s=7200)[1]
    assert cadence.interval_s(5, 0, faults=4, observed_s=7200) < cadence.interval_s(5, 0)


def recipe(every) -> Recipe:
    return Recipe.model_validate({"name": "r", "model": {"base": "tiny-llama"}, "data": {"train": "x.jsonl"},
                                  "resources": {"nodes": 3, "spare_nodes": 1},
                                  "training": {"steps": 10, "micro_batch": 1, "global_batch": 3},
                                  "checkpoint": {"every_minutes": every}})


def test_the_job_mtbf_is_the_node_mtbf_over_every_node_held_and_only_for_auto():
    lab = load_profile("lab")
    assert derive(recipe("auto"), lab).job_mtbf_hours == round(lab.node_mtbf_hours / 4, 2)
    assert derive(recipe(30), lab).job_mtbf_hours is None


def test_every_minutes_takes_auto_or_a_positive_number_only():
    from pydantic import ValidationError

    assert recipe("auto").checkpoint.every_minutes == "auto"
    for wrong in ("sometimes", 0, -5):
        with pytest.raises(ValidationError):
            recipe(wrong)


def test_the_clock_is_off_unless_the_recipe_asks_for_it():
    """every_minutes used to default to 30 and ran silently beside every_steps: now unset means no
    saves by the clock, and the steps alone decide."""
    plain = Recipe.model_validate({"name": "r", "model": {"base": "tiny-llama"}, "data": {"train": "x.jsonl"}})
    assert plain.checkpoint.every_minutes is None and plain.checkpoint.every_steps == 100
    cadence = Cadence.of(plain.checkpoint.every_steps, plain.checkpoint.every_minutes, None)
    assert cadence.interval_s(1.0, 0.0) == 0 and not cadence.on_clock
    assert not cadence.clock_due(since_last_save_s=10 * 86400, save_cost_s=1.0, write_s=0.0)
    assert [step for step in range(1, 301) if cadence.steps_due(step)] == [100, 200, 300]


def test_the_cadence_owns_steps_minutes_and_auto_alike():
    fixed = Cadence.of(None, 20.0, job_mtbf_hours=50)
    assert fixed.interval_s(None, 0.0) == 1200 and fixed.describe(None, 0.0) is None and fixed.on_clock
    assert not fixed.clock_due(1199, None, 0.0) and fixed.clock_due(1200, None, 0.0)
    assert not any(fixed.steps_due(step) for step in range(1, 1000))
    asked: list[bool] = []

    def history() -> tuple[int, float]:
        asked.append(True)
        return 4, 7200.0

    auto = Cadence.of(50, "auto", job_mtbf_hours=100, history=history)
    assert asked == [True] and auto.steps_due(50) and not auto.steps_due(51)
    assert auto.interval_s(None, 0.0) == FIRST_INTERVAL_S  # nothing measured yet
    assert auto.interval_s(5.0, 0.0) == pytest.approx(AutoCadence(100).interval_s(5.0, 0.0, *auto.seen()), rel=1e-3)
    assert auto.interval_s(5.0, 0.0) < AutoCadence(100).interval_s(5.0, 0.0)  # the run's 4 faults count
    assert "Young/Daly" in auto.describe(5.0, 0.0)
    Cadence.of(50, 30.0, None, history=history)
    assert asked == [True]  # the run's history is read only for auto
