"""Where a run's time went, from its events and stamped metrics: a run with one fault."""

from __future__ import annotations

import json

from toolkit.runs.timeline import timeline


def write_lines(path, entries) -> None:
    path.write_text("".join(json.dumps(entry) + "\n" for entry in entries))


def test_goodput_counts_first_time_steps_only_and_names_where_the_rest_went(tmp_path):
    write_lines(tmp_path / "events.jsonl", [
        {"time": 100, "event": "start", "start": 1}, {"time": 125, "event": "restart", "after": "exit 6"},
        {"time": 127, "event": "start", "start": 2}, {"time": 142, "event": "end", "code": 0}])
    first = [{"step": step, "time": 109 + step} for step in range(1, 11)]  # 1 s a step; first after 10 s
    second = [{"step": step, "time": 129 + step} for step in range(6, 13)]  # resumed from the step-5 checkpoint
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in first + second) + '{"step": 1, "ti\n')

    spent = timeline(tmp_path)

    assert spent["wall_s"] == 42 and spent["finished"]
    assert spent["starting_s"] == 10 + 8  # each start until its first step
    assert spent["productive_s"] == 9 + 2  # steps 2-10, then 11-12
    assert spent["redone_s"] == 4  # steps 7-10 again (6 was the new start's first step)
    assert spent["recovering_s"] == 2
    assert spent["other_s"] == 42 - 11 - 4 - 18 - 2
    assert spent["goodput"] == round(11 / 42, 3)
    assert [f["event"] for f in spent["faults"]] == ["restart"]


def test_no_timeline_before_the_watchdog_recorded_a_start(tmp_path):
    assert timeline(tmp_path) is None
    (tmp_path / "events.jsonl").write_text("not json\n")
    assert timeline(tmp_path) is None
