"""Rank 0's metrics lines (toolkit/train/tracking.py): each says the run's planned steps once the
worker knows them (`ft status --watch`'s ETA), and the W&B artifact is named for what it holds."""

from __future__ import annotations

import json
import time

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
