"""`ft report`'s page (toolkit/report): drawn from a run's files, self-contained, every value from a
file shown as text. A real browser renders a real run's page in the lab (tests/lab/test_monitoring.py)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from toolkit.report.charts import ticks
from toolkit.report.page import by_start, render, throughput
from toolkit.runs.status import RunStatus
from toolkit.runs.store import RunRecord
from toolkit.runs.timeline import timeline
from toolkit.slurm.client import JobInfo

HOSTILE = '</td><script>alert("x")</script><img src=http://example.com/x>'


def run_folder(tmp_path: Path) -> Path:
    now = time.time() - 600
    lines = [{"step": s, "time": now + 10 + s, "loss": 3 - s / 50, "tokens": 100 * s} for s in range(1, 61)]
    lines += [{"step": s, "time": now + 100 + s, "loss": 3 - s / 50, "tokens": 100 * (s - 40)} for s in range(41, 121)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    events = [{"time": now, "job": "7", "event": "start", "start": 1, "nodes": ["node1", "node2"]},
              {"time": now + 75, "job": "7", "event": "node_lost", "node": "node2", "reason": HOSTILE},
              {"time": now + 95, "job": "8", "event": "start", "start": 1, "nodes": ["node1", "node3"]},
              {"time": now + 230, "job": "8", "event": "end", "code": 0}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / "data-report.json").write_text(json.dumps([{
        "path": f"/data/{HOSTILE}.jsonl", "format": "chat", "rows": 10, "valid_rows": 9, "ok": True,
        "errors": {"bad_json": {"count": 1}}, "warnings": {}, "tokens": {"mean": 5.0, "p95": 9.0, "max": 12}}]))
    return tmp_path


def status(folder: Path) -> RunStatus:
    record = RunRecord(f"run-{HOSTILE}", "tiny", "/r.yaml", "lab", "train", time.time() - 700)
    return RunStatus(record, folder, JobInfo("8", "COMPLETED", "sacct", "node[1,3]"),
                     [{"job_id": "7", "restart": 0, "start": 1, "nodes": ["node1", "node2"], "started": time.time()}],
                     summary={"steps": 120, "gpu_hours": 2.5, "final_loss": 0.6},
                     timeline=timeline(folder), checkpoints={"shared": {"step": 120}, "remote": None})


def test_the_page_draws_the_runs_curves_timeline_and_time(tmp_path):
    page = render(status(run_folder(tmp_path)), price_per_gpu_hour=2.0)
    assert page.count("<svg") == 4  # loss, throughput, starts and faults, where the time went
    assert page.count("<polyline") == 4  # each curve drawn per start: it resumed at step 41
    assert page.count('stroke-dasharray="4 3"') == 2  # the restart marked on both curves
    assert "job 7" in page and "job 8" in page  # a lane per job
    assert "$5.00" in page and "2.50" in page  # 2.5 GPU-hours at $2
    assert "bad_json: 1" in page and "9" in page


def test_every_value_from_a_file_is_text_and_nothing_is_fetched(tmp_path):
    page = render(status(run_folder(tmp_path)))
    assert "<script" not in page and "<img" not in page
    assert "&lt;script&gt;" in page
    assert not re.search(r"<[a-zA-Z][^>]*\s(src|href)\s*=", page)  # self-contained: no tag loads anything
    assert "price_per_gpu_hour" in page  # no price: said, not a made-up cost


def test_a_run_that_has_not_started_still_gets_a_page(tmp_path):
    record = RunRecord("r0", "tiny", "/r.yaml", "lab", "train", time.time())
    page = render(RunStatus(record, tmp_path, JobInfo("9", "PENDING", "squeue"), []))
    assert "PENDING" in page and "not enough steps to draw" in page and "the run has not started" in page


def test_throughput_never_spans_a_restart(tmp_path):
    starts = by_start([json.loads(line) for line in (run_folder(tmp_path) / "metrics.jsonl").read_text().splitlines()])
    assert [len(start) for start in starts] == [60, 80]
    for start in starts:
        assert all(rate == pytest.approx(100.0) for _, rate in throughput(start))


@pytest.mark.parametrize("low, high", [(0, 1), (1, 120), (0.3, 0.31), (0, 4000)])
def test_ticks_are_round_and_inside(low, high):
    found = ticks(low, high)
    assert 2 <= len(found) <= 11 and all(low - 1e-9 <= t <= high + 1e-9 for t in found)


def test_damaged_or_hostile_files_still_give_a_page(tmp_path):
    """What other users of a shared filesystem, or a crash, can leave in a run's files."""
    now = time.time() - 100
    lines = [{"step": 1, "time": now, "loss": 1e308, "tokens": 10**400}, {"step": 2, "time": now + 1, "loss": -1e308},
             {"step": 3, "time": now + 2, "loss": 0.0}, {"step": 4, "time": now + 3, "loss": 5e-324},
             {"step": 5, "time": float("nan")}, "[" * 5000]
    (tmp_path / "metrics.jsonl").write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n"
                                                    for line in lines))
    (tmp_path / "events.jsonl").write_text(json.dumps({"time": now, "event": "start", "nodes": 5}) + "\n")
    (tmp_path / "data-report.json").write_text(json.dumps(["a string", {"errors": ["x"], "warnings": {"dup": 3},
                                                                        "tokens": [1]}]))
    (tmp_path / "summary.json").write_text("[1]")
    record = RunRecord("r-damaged", "tiny", "/r.yaml", "lab", "train", 1e300)
    page = render(RunStatus(record, tmp_path, JobInfo("9", "RUNNING", "squeue"),
                            [{"job_id": "9", "restart": 0, "nodes": ["n1"], "started": float("nan")}],
                            timeline=timeline(tmp_path)))
    assert "r-damaged" in page and "<svg" in page and "built-in method" not in page
    from toolkit.runs.status import read_json

    assert read_json(tmp_path / "summary.json") is None  # what ft status reads: a list is no summary


def test_a_very_long_run_is_thinned_to_its_whole_curve(tmp_path):
    from toolkit.report.page import step_lines
    from toolkit.runs.layout import RunLayout

    now = time.time() - 10_000
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "time": now + s, "loss": 1.0}) + "\n"
                                                    for s in range(1, 5001)))
    kept = step_lines(RunLayout(tmp_path), most=100)
    assert kept[0]["step"] == 1 and kept[-1]["step"] == 5000 and len(kept) <= 101
    steps = [line["step"] for line in kept]
    assert steps == sorted(steps) and max(b - a for a, b in zip(steps, steps[1:], strict=False)) <= 64  # evenly


def test_values_at_floats_edge_draw_no_broken_coordinates():
    """A loss of +-1e308 (a diverged run's) would make the y range infinite, every coordinate NaN."""
    from toolkit.report.charts import line_chart

    svg = str(line_chart([[(1, 2.5), (2, 1e308), (3, -1e308), (4, 2.0), (5, float("nan")), (6, 1.5)]],
                         "step", "loss"))
    assert "nan" not in svg.lower() and "inf" not in svg.lower() and "<polyline" in svg
