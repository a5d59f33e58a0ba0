"""Rank 0's metrics lines (toolkit/train/tracking.py): each says the run's planned steps once the
worker knows them (`ft status --watch`'s ETA), and the W&B artifact is named for what it holds."""

from __future__ import annotations

import json
import time

import pytest

from tests.support.run_specs import run_spec
from toolkit.runs.layout import RunLayout
from toolkit.runs.progress import read_progress
from toolkit.train.step_signals import StepRecord
from toolkit.train.tracking import Tracker, artifact_name


def test_lines_carry_the_plan_once_known_and_the_progress_reads_it(tmp_path):
    base = run_spec().recipe
    recipe = base.model_validate(base.model_dump(mode="json") | {"tracking": {"wandb": {"mode": "disabled"}}})
    tracker = Tracker(RunLayout(tmp_path), recipe, rank=0)
    now = time.time()
    tracker.log([StepRecord(1, now + 1, 1e-4, 100, 2.0, None)])
    tracker.total_steps = 50
    tracker.log([StepRecord(step, now + step, 1e-4, 100 * step, 2.0, None) for step in (2, 3)])
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "of" not in lines[0] and [line["of"] for line in lines[1:]] == [50, 50]
    progress = read_progress(tmp_path / "metrics.jsonl")
    assert progress.total_steps == 50 and progress.eta_seconds() == 47 * 1.0


def test_the_artifact_is_named_for_what_it_holds():
    assert artifact_name("run-1", "lora") == "run-1-lora-adapter"
    assert artifact_name("run-1", "qlora") == "run-1-qlora-adapter"
    assert artifact_name("run-1", "full") == "run-1-full-model"  # a whole model, not an adapter


class RecordingRun:
    """What a started W&B run is told (no W&B server here; tests/unit/test_wandb_sync.py takes the
    real client through `ft sync`)."""

    def __init__(self):
        self.defined: list[tuple[str, dict]] = []
        self.logged: list[dict] = []

    def define_metric(self, name, **options):
        self.defined.append((name, options))

    def log(self, values, **options):
        assert options == {}, "a step= below W&B's last one is dropped: ft never passes one"
        self.logged.append(values)

    @property
    def summary(self) -> dict:
        return self.__dict__.setdefault("_summary", {})


def test_steps_redone_after_a_restart_reach_wb_along_the_training_step(tmp_path, monkeypatch):
    """A start after a fault resumes from its checkpoint and redoes the steps since: W&B keeps them,
    charted along train/step (W&B drops a `step=` below the highest it has seen)."""
    import sys
    import types

    run = RecordingRun()
    run.url, run.dir = "https://wandb.example/run", str(tmp_path / "wandb" / "files")
    fake = types.SimpleNamespace(init=lambda **options: run)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    base = run_spec().recipe
    recipe = base.model_validate(base.model_dump(mode="json") | {"tracking": {"wandb": {"mode": "offline"}}})
    now = time.time()
    for steps in ((1, 2, 3, 4, 5), (4, 5, 6)):  # the second start resumed from step 3's checkpoint
        tracker = Tracker(RunLayout(tmp_path), recipe, rank=0)
        tracker.starting.join()
        tracker.log([StepRecord(step, now + step, 1e-4, 100 * step, 3.0 / step, None) for step in steps])
    assert ("train/*", {"step_metric": "train/step"}) in run.defined
    assert [values["train/step"] for values in run.logged] == [1, 2, 3, 4, 5, 4, 5, 6]
    assert run.logged[-1] == {"train/step": 6, "train/loss": 0.5, "train/lr": 1e-4, "train/tokens": 600}


def test_the_evaluation_reaches_the_wb_summary_per_model_split_and_gate(tmp_path, monkeypatch):
    import sys
    import types

    run = RecordingRun()
    run.url, run.dir = "https://wandb.example/run", str(tmp_path / "wandb" / "files")
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **options: run))
    base = run_spec().recipe
    recipe = base.model_validate(base.model_dump(mode="json") | {"tracking": {"wandb": {"mode": "offline"}}})
    tracker = Tracker(RunLayout(tmp_path), recipe, rank=0)
    tracker.evaluation({"base": {"held_out": {"loss": 6.2}, "golden": None},
                        "adapter": {"held_out": {"loss": 1.4, "perplexity": 4.1},
                                    "golden": {"loss": 1.3, "metrics": {"exact_match": 1.0}}},
                        "gates": [{"name": "held_out_loss_drop", "passed": True, "detail": ""}],
                        "state": "promoted"})
    assert run.summary == {"eval/base/held_out/loss": 6.2, "eval/adapter/held_out/loss": 1.4,
                           "eval/adapter/held_out/perplexity": 4.1, "eval/adapter/golden/loss": 1.3,
                           "eval/adapter/golden/exact_match": 1.0, "eval/gates/held_out_loss_drop": 1,
                           "eval/state": "promoted"}


class FailingRun(RecordingRun):
    """A W&B run whose client fails the way wandb's does when its service dies: with its own error
    type (here a RuntimeError), which no narrower `except` could name for every wandb version."""

    def __init__(self, failing: str):
        super().__init__()
        self.failing = failing
        self.url, self.dir = "https://wandb.example/run", "/nonexistent/wandb/files"

    def log(self, values, **options):
        if self.failing == "log":
            raise RuntimeError("The wandb backend process has shutdown")
        super().log(values, **options)

    def finish(self):
        if self.failing == "finish":
            raise RuntimeError("The wandb backend process has shutdown")

    @property
    def summary(self):
        if self.failing == "summary":
            raise RuntimeError("The wandb backend process has shutdown")
        return super().summary


@pytest.mark.parametrize("failing", ["init", "log", "summary", "finish"])
def test_wb_failing_anywhere_never_stops_training_and_the_metrics_file_keeps_every_line(tmp_path, monkeypatch,
                                                                                       capsys, failing):
    """The four blind excepts of toolkit/train/tracking.py: W&B's start, its log, the evaluation's
    summary and its finish each raise what the wandb client raises; training's own record goes on."""
    import sys
    import types

    def init(**options):
        if failing == "init":
            raise RuntimeError("wandb.errors.CommError: Run initialization has timed out")
        return FailingRun(failing)

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    base = run_spec().recipe
    recipe = base.model_validate(base.model_dump(mode="json") | {"tracking": {"wandb": {"mode": "offline"}}})
    tracker = Tracker(RunLayout(tmp_path), recipe, rank=0)
    tracker.starting.join()
    now = time.time()
    tracker.log([StepRecord(step, now + step, 1e-4, 100 * step, 3.0 / step, None) for step in (1, 2, 3)])
    tracker.evaluation({"base": {"held_out": {"loss": 6.2}, "golden": None}, "gates": [], "state": "draft",
                        "adapter": {"held_out": {"loss": 1.4}, "golden": None}})
    tracker.finish()
    lines = RunLayout(tmp_path).metrics.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if '"step"' in line][-3:] == [1, 2, 3]
    assert "warning: W&B" in capsys.readouterr().out
