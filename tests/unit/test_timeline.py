"""Where a run's time went, from its events and stamped metrics: a run with one fault."""

from __future__ import annotations

import json

from toolkit.runs.timeline import timeline


def write_lines(path, entries) -> None:
    path.write_text("".join(json.dumps(entry) + "\n" for entry in entries))


def test_goodput_counts_first_time_steps_only_and_names_where_the_rest_went(tmp_path):
    t = 1_700_000_000
    write_lines(tmp_path / "events.jsonl", [
        {"time": t + 100, "event": "start", "start": 1}, {"time": t + 125, "event": "restart", "after": "exit 6"},
        {"time": t + 127, "event": "start", "start": 2}, {"time": t + 142, "event": "end", "code": 0}])
    first = [{"step": step, "time": t + 109 + step} for step in range(1, 11)]  # 1 s a step; first after 10 s
    second = [{"step": step, "time": t + 129 + step} for step in range(6, 13)]  # resumed from the step-5 checkpoint
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in first + second) + '{"step": 1, "ti\n')

    spent = timeline(tmp_path)

    assert spent["wall_s"] == 42 and spent["finished"]
    assert spent["starting_s"] == 10 + 8  # each start until its first step
    assert spent["productive_s"] == 9 + 2  # steps 2-10, then 11-12
    assert spent["redone_s"] == 4  # steps 7-10 again (6 was the new start's first step)
    assert spent["recovering_s"] == 8  # from step 10, the last before the fault: its detection counts
    assert spent["other_s"] == 42 - 11 - 4 - 18 - 8
    assert spent["goodput"] == round(11 / 42, 3)
    assert [f["event"] for f in spent["faults"]] == ["restart"]
    # The fault's episode and what it cost, as one span: the wait from step 10 (t+119) to the start,
    # that start until its first step (t+135), the steps it redid (to t+139).
    (episode,) = spent["episodes"]
    assert episode["time"] == t + 125 and episode["events"] == ["restart"] and episode["nodes"] == []
    assert episode["spans"] == [[t + 119, t + 139]]


def test_a_preemption_is_no_episode_and_a_node_lost_then_restarted_is_one(tmp_path):
    t = 1_700_000_000
    write_lines(tmp_path / "events.jsonl", [
        {"time": t, "event": "start"}, {"time": t + 20, "event": "end", "code": 8}, {"time": t + 30, "event": "start"},
        {"time": t + 50, "event": "node_lost", "node": "n2"}, {"time": t + 51, "event": "restart"},
        {"time": t + 60, "event": "start"}, {"time": t + 90, "event": "end", "code": 0}])
    steps = [(t + 5 + s, s) for s in range(1, 10)] + [(t + 35 + s, s) for s in range(6, 14)] \
        + [(t + 65 + s, s) for s in range(12, 20)]
    write_lines(tmp_path / "metrics.jsonl", [{"step": s, "time": when} for when, s in steps])
    (episode,) = timeline(tmp_path)["episodes"]  # the preemption's redone steps are no fault's
    assert episode["events"] == ["node_lost", "restart"] and episode["nodes"] == ["n2"]
    assert episode["spans"] == [[t + 48, t + 78]]  # from step 13 to the restart's first new step


def test_a_lost_batch_host_a_successor_took_over_from_costs_nothing(tmp_path):
    """Training never stopped (toolkit/job/successor.py): the episode is named, with no time to it."""
    t = 1_700_000_000
    write_lines(tmp_path / "events.jsonl", [
        {"time": t, "event": "start", "start": 1}, {"time": t + 31, "event": "node_lost", "node": "n3"},
        {"time": t + 31.4, "event": "took_over", "lost": "n3"}, {"time": t + 60, "event": "end", "code": 0}])
    write_lines(tmp_path / "metrics.jsonl", [{"step": s, "time": t + 5 + s} for s in range(1, 55)])
    spent = timeline(tmp_path)
    (episode,) = spent["episodes"]
    assert episode["nodes"] == ["n3"] and episode["spans"] == []
    assert spent["recovering_s"] == 0 and spent["productive_s"] == 53 and spent["redone_s"] == 0


def test_no_timeline_before_the_watchdog_recorded_a_start(tmp_path):
    assert timeline(tmp_path) is None
    (tmp_path / "events.jsonl").write_text("not json\n")
    assert timeline(tmp_path) is None


def test_torn_forged_or_skewed_lines_never_break_the_accounts(tmp_path):
    (tmp_path / "events.jsonl").write_text("\n".join([
        '{"time": 1700000050, "event": "end", "code": 0}',  # written last, read first
        '{"time": 1700000000, "event": "start"}',
        '{"time": ' + "9" * 400 + ', "event": "restart"}',  # an integer no float can hold
        '{"time": NaN, "event": "node_lost"}', '{"time": 1e300, "event": "restart"}',
        '{"time": "soon", "event": "start"}', '[]', '{"time": 1700000010, "event": 5}']) + "\n")
    (tmp_path / "metrics.jsonl").write_text("\n".join([
        '{"step": 1, "time": 1700000005}', '{"step": 2, "time": 1700000006}',
        '{"step": 3, "time": 1600000000}',  # another node's clock, far behind
        '{"step": -4, "time": 1700000007}', '{"step": 5, "time": Infinity}']) + "\n")

    spent = timeline(tmp_path)

    assert spent["wall_s"] == 50 and spent["finished"] and spent["faults"] == []
    assert 0 <= spent["goodput"] <= 1 and spent["productive_s"] == 1 and spent["starting_s"] == 5


def test_a_spares_start_stamped_with_its_faults_time_still_counts_the_detection(tmp_path):
    t = 1_700_000_000
    write_lines(tmp_path / "events.jsonl", [
        {"time": t, "event": "start", "start": 1}, {"time": t + 20, "event": "node_lost", "node": "n2"},
        {"time": t + 20, "event": "restart"}, {"time": t + 20, "event": "start", "start": 2},
        {"time": t + 30, "event": "end", "code": 0}])
    write_lines(tmp_path / "metrics.jsonl", [{"step": 1, "time": t + 5}, {"step": 2, "time": t + 15},
                                             {"step": 2, "time": t + 23}, {"step": 3, "time": t + 30}])
    spent = timeline(tmp_path)
    assert spent["recovering_s"] == 5  # step 2 at t+15, the loss judged at t+20 (the heartbeat timeout)
    assert spent["starting_s"] == 5 + 3


def test_a_fifo_in_place_of_a_runs_file_is_not_waited_on(tmp_path):
    """A FIFO where events.jsonl or metrics.jsonl should be would block every reader for good (ft
    status, ft report, the run's scrape): it is no file of the run's, and reads as empty."""
    import os
    import threading

    from toolkit.report.page import metrics_entries
    from toolkit.runs.progress import tail_lines

    for name in ("events.jsonl", "metrics.jsonl"):
        os.mkfifo(tmp_path / name)
    answers = []
    metrics = tmp_path / "metrics.jsonl"
    reader = threading.Thread(target=lambda: answers.append(
        (timeline(tmp_path), tail_lines(metrics), list(metrics_entries(metrics)))), daemon=True)
    reader.start()
    reader.join(timeout=20)
    assert answers == [(None, [], [])]
