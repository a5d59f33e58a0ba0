"""`ft status RUN --watch`'s view (toolkit/cli/live.py), drawn from a run's files into rich's
recording console. The lab test follows a real run through a requeue in tmux
(tests/lab/test_recovery.py::test_a_run_near_its_time_limit_checkpoints_requeues_and_resumes)."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

from rich.console import Console

from toolkit.cli import live
from toolkit.runs.status import RunStatus
from toolkit.runs.store import RunRecord
from toolkit.slurm.client import JobInfo
from toolkit.slurm.nodes import parse_node_states


def status(run_dir: Path, state: str, timeline: dict | None = None) -> RunStatus:
    record = RunRecord("r1", "tiny", "/r.yaml", "lab", "train", time.time())
    return RunStatus(record, run_dir, JobInfo("42", state, "squeue", "node[1-2]"), [], timeline=timeline,
                     checkpoints={"shared": {"step": 40, "at": time.time()}, "remote": None})


def drawn(renderable) -> str:
    console = Console(record=True, width=110, force_terminal=True)
    console.print(renderable)
    return console.export_text()


def test_a_frame_shows_progress_eta_faults_and_the_nodes(tmp_path):
    now = time.time()
    lines = [{"step": s, "time": now - 50 + s, "loss": 2.0 - s / 100, "tokens": 100 * s, "of": 120}
             for s in range(1, 51)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    timeline = {"starts": 2, "goodput": 0.8, "wall_s": 300,
                "faults": [{"time": now - 100, "event": "node_lost", "node": "node2", "reason": "no heartbeat"}]}
    nodes = parse_node_states("node1|allocated|none\nnode2|drained|ft-health: gpu 2 ECC\n")
    text = drawn(live.frame(status(tmp_path, "RUNNING", timeline), nodes, now, now))
    assert "run r1" in text and "RUNNING" in text and "job 42" in text
    assert "50/120" in text and "1.5000" in text and "100" in text  # step, loss, tokens/s
    assert "1m10s" in text  # 70 steps left at 1 s each
    assert "1 restart," in text and "node_lost node2 no heartbeat" in text
    assert "checkpoints: step 40 on the shared filesystem" in text
    assert "node2" in text and "ft-health: gpu 2 ECC" in text


def test_a_run_before_its_first_step_is_drawn_without_numbers(tmp_path):
    text = drawn(live.frame(status(tmp_path, "PENDING"), {}, time.time(), time.time()))
    assert "PENDING" in text and "step" in text


def test_the_view_follows_through_a_requeue_and_ends_with_the_job(tmp_path, monkeypatch):
    states = iter(["RUNNING", "PENDING", "RUNNING", "COMPLETED"])
    monkeypatch.setattr(live.time, "sleep", lambda seconds: None)
    asked = []
    piped = io.StringIO()
    console = Console(file=piped)  # not a terminal: `ft status --watch | tee`
    final = live.watch(lambda: status(tmp_path, next(states)), 1.0, console,
                       read_nodes=lambda nodelist: asked.append(nodelist) or {})
    console.print("run r1: COMPLETED")
    assert final.state == "COMPLETED"
    assert "\nrun r1: COMPLETED\n" in piped.getvalue()  # what follows the view starts a line of its own
    assert asked == ["node[1-2]", "node[1-2]"]  # Slurm is asked about the nodes only while they run the job


def test_escape_sequences_from_the_runs_files_never_reach_the_terminal(tmp_path):
    now = time.time()
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 3, "time": float("nan"), "loss": 1.0}) + "\n"
                                            + json.dumps({"step": 4, "time": now, "loss": 1.0, "of": 10**400}) + "\n")
    hostile = "\x1b]0;pwned\x07\x1b[2J"
    timeline = {"starts": 1, "goodput": 0.5, "wall_s": float("inf"),
                "faults": [{"time": now, "event": "node_lost", "node": f"n{hostile}", "reason": hostile}]}
    current = status(tmp_path, "RUNNING", timeline)
    current.checkpoints = {"shared": {"step": 3}, "remote": {"url": f"s3://b{hostile}", "step": None,
                                                             "error": hostile, "retrying": True}}
    text = drawn(live.frame(current, parse_node_states(f"n1|drained|{hostile}\n"), now, now))
    assert "\x1b]" not in text and "\x1b[2J" not in text and "pwned" in text  # shown, made harmless
    assert "4/" not in text  # an absurd plan (a 400-digit "of") is no plan


def test_the_view_goes_on_without_the_nodes_whatever_asking_slurm_raises(tmp_path):
    """cli/live.py's blind except: what reading the nodes raises is Slurm's client's, or rich's, or a
    parse of a version ft has not met; the view draws the run without them."""
    def broken(nodelist: str) -> dict:
        raise RuntimeError(f"sinfo answered something new for {nodelist}")

    assert live.job_nodes(status(tmp_path, "RUNNING"), broken) == {}
    assert live.job_nodes(status(tmp_path, "PENDING"), broken) == {}  # not asked before the job runs
