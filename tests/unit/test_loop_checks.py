"""The loop's NaN check (toolkit/train/loop.py) on what DeepSpeed reports: a non-finite gradient norm
stops a bf16 or fp32 run before its checkpoint, and is fp16's normal skipped step."""

from __future__ import annotations

import pytest

from toolkit.recipe.schema import Recipe
from toolkit.runs import exits
from toolkit.runs.exits import RunEnds
from toolkit.train.faults import Faults
from toolkit.train.loop import Loop

torch = pytest.importorskip("torch")


class OneRank:
    @staticmethod
    def all_reduce(tensor, group=None):
        return tensor


class Tracker:
    def __init__(self):
        self.logged = []

    def log(self, records):
        self.logged += records


def loop_for(precision: str) -> Loop:
    recipe = Recipe.model_validate({"name": "r", "model": {"base": "tiny-llama"}, "data": {"train": "t.jsonl"},
                                    "training": {"precision": precision}})
    return Loop(engine=None, dist=OneRank(), rank=0, world=1, recipe=recipe, plan=None, units=[], objective=None,
                pad_id=0, tracker=Tracker(), checkpointer=None, progress=None, faults=Faults(), log=lambda _: None,
                stop_requested=lambda: False, backend="gloo")


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_an_infinite_gradient_norm_stops_a_run_that_skips_no_step(precision):
    loop = loop_for(precision)
    loop.window.add(1, torch.tensor(2.0), None, 1e-4, 100, torch.tensor(float("inf")))
    with pytest.raises(RunEnds) as ended:
        loop.read_losses(0, 10)
    assert ended.value.code == exits.USER_ERROR and "the gradient norm is inf at step 1" in str(ended.value)


def test_fp16s_skipped_step_goes_on():
    loop = loop_for("fp16")
    loop.window.add(1, torch.tensor(2.0), None, 1e-4, 100, torch.tensor(float("inf")))  # an overflow, skipped
    loop.read_losses(0, 10)
    assert [record.grad_norm for record in loop.tracker.logged] == [float("inf")]
