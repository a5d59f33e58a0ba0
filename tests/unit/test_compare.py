"""`ft compare` (toolkit/report/compare.py): runs side by side, from their own files. The fields in
which their recipes differ are found, whatever the runs are; what each did is read from its metrics,
summary, evaluation and timeline, a torn or damaged file costing only its own cells."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tests.support.run_specs import run_spec, write_run_spec
from toolkit.recipe.resolve import dotted_values
from toolkit.report.compare import compare, varied_fields
from toolkit.runs.status import RunStatus
from toolkit.runs.store import RunRecord
from toolkit.slurm.client import JobInfo


def finished_run(folder: Path, run_id: str, learning_rate: float, rank: int, losses: list[float]) -> RunStatus:
    """A run of the unit spec with its learning rate and LoRA rank set, its step lines (one start,
    100 tokens a second), its summary and evaluation."""
    folder.mkdir()
    spec = run_spec(2)
    spec.recipe.training.learning_rate, spec.recipe.method.rank = learning_rate, rank
    write_run_spec(folder, spec)
    began = time.time() - 600
    lines = [{"step": step, "time": began + step, "loss": loss, "tokens": 100 * step}
             for step, loss in enumerate(losses, 1)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 9, "lo\n')
    record = RunRecord(run_id, "unit", "/r.yaml", "lab", "train", began)
    return RunStatus(record, folder, JobInfo("7", "COMPLETED", "sacct", "node[1-2]"), [],
                     summary={"steps": len(losses), "final_loss": losses[-1], "gpu_hours": 0.5},
                     timeline={"goodput": 0.9},
                     evaluation={"adapter": {"eval": {"loss": losses[-1] + 0.1}, "golden": None}, "state": "passed"})


def test_runs_are_compared_on_the_fields_that_differ_and_on_what_each_did(tmp_path):
    low = finished_run(tmp_path / "low", "sweep-lr1", 1e-4, 8, [2.0, 1.5, 1.2, 1.3])
    high = finished_run(tmp_path / "high", "sweep-lr3", 3e-4, 16, [2.0, 1.1, 0.9, 0.95])
    found = compare([low, high])
    assert found.varied == ["method.rank", "training.learning_rate"]  # the rest of their recipes alike
    first, second = found.runs
    assert (first.run_id, first.varied) == ("sweep-lr1", {"method.rank": 8, "training.learning_rate": 1e-4})
    assert second.varied == {"method.rank": 16, "training.learning_rate": 3e-4}
    assert (first.final_loss, first.best_loss, second.best_loss) == (1.3, 1.2, 0.9)  # best: not the last
    assert first.tokens_per_s == 100.0 and first.steps == 4 and first.gpu_hours == 0.5 and first.goodput == 0.9
    assert first.eval_loss == {"eval": 1.3 + 0.1} and first.verdict == "passed" and first.state == "COMPLETED"
    assert json.loads(json.dumps(found.to_dict()))["varied"] == found.varied  # --json: plain JSON


def test_a_run_whose_files_are_damaged_is_still_compared_on_what_can_be_read(tmp_path):
    sound = finished_run(tmp_path / "sound", "a", 1e-4, 8, [2.0, 1.0])
    damaged = finished_run(tmp_path / "damaged", "b", 3e-4, 8, [2.0, 1.5])
    (damaged.run_dir / "recipe.json").write_text("{not json")
    (damaged.run_dir / "metrics.jsonl").write_text('{"step": "one", "loss": 0.1}\n[]\n')
    damaged = RunStatus(damaged.run, damaged.run_dir, None, [], summary={"final_loss": "NaN", "steps": True},
                        evaluation={"adapter": ["not", "a", "mapping"], "state": 3})
    found = compare([sound, damaged])
    assert found.varied == []  # one readable recipe: nothing to tell apart
    row = found.runs[1]
    assert row.state == "UNKNOWN" and row.best_loss is None and row.tokens_per_s is None
    assert row.final_loss is None and row.steps is None and row.eval_loss == {} and row.verdict is None


def test_fields_missing_from_one_recipe_count_as_differing_and_the_runs_name_never_does():
    spec = run_spec(1, env={"HF_HOME": "/x"})
    spec.recipe.training.learning_rate = 1e-4
    fields = dotted_values(spec.recipe)  # the recipe's own dotted fields (ft render's sources use them)
    assert fields["training.learning_rate"] == 1e-4 and fields["name"] == "unit" and fields["env"] == {"HF_HOME": "/x"}
    recipes = [{"name": "a", "training.seed": 1}, {"name": "b"}, None]
    assert varied_fields(recipes) == ["training.seed"]


def test_ft_compare_prints_the_runs_side_by_side_and_wants_two(tmp_path):
    import os
    import subprocess
    import sys

    for folder, learning_rate in (("r-low", 1e-4), ("r-high", 3e-4)):
        finished_run(tmp_path / folder, folder, learning_rate, 8, [2.0, 1.0])
        (tmp_path / folder / "run.json").write_text(json.dumps({
            "run_id": folder, "recipe_name": "unit", "recipe_path": "/r.yaml", "cluster": "lab", "mode": "train",
            "created": time.time(), "idempotency_key": None, "jobs": []}))
        (tmp_path / folder / "summary.json").write_text(json.dumps({"steps": 2, "final_loss": 1.0, "gpu_hours": 0.5}))
    env = {**os.environ, "FT_RUNS_DIR": str(tmp_path), "COLUMNS": "250"}

    def ft(*args):
        return subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, timeout=120,
                              env=env)

    shown = ft("compare", "r-low", "r-high")
    assert shown.returncode == 0, shown.stderr
    assert "differing in training.learning_rate" in shown.stdout
    assert "0.0001" in shown.stdout and "0.0003" in shown.stdout and "0.500" in shown.stdout
    as_json = json.loads(ft("compare", "r-low", "r-high", "--json").stdout)
    assert [run["run_id"] for run in as_json["runs"]] == ["r-low", "r-high"]
    alone = ft("compare", "r-low", "r-low")
    assert alone.returncode != 0 and "two runs or more" in alone.stderr
