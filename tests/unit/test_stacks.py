"""Reading a py-spy dump: a dump whose main thread came without frames (py-spy caught it between
two, as seen on the lab) is asked for again; one with them is kept."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from toolkit.watch.stacks import main_thread_frames, process_state

HEADER = "Process 21300: python -u -m toolkit.train.worker\nPython v3.11.7 (/usr/bin/python3.11)\n\n"
MAIN_WITH_FRAMES = 'Thread 21300 (active): "MainThread"\n    agree (toolkit/train/step_signals.py:77)\n' \
                   "    train (toolkit/train/worker.py:103)\n"
MAIN_BARE = 'Thread 21300 (active): "MainThread"\n'
OTHER = 'Thread 21310 (idle): "ft-heartbeat"\n    wait (threading.py:324)\n    run (toolkit/watch/heartbeat.py:70)\n'


def test_a_dump_counts_only_when_the_main_thread_has_frames():
    assert main_thread_frames(HEADER + MAIN_WITH_FRAMES + OTHER)
    assert not main_thread_frames(HEADER + MAIN_BARE + OTHER)  # the lab's flaky case: other threads only
    assert not main_thread_frames(HEADER + OTHER + MAIN_BARE)
    assert main_thread_frames(HEADER + OTHER + MAIN_WITH_FRAMES)


def test_a_dump_without_thread_names_counts_any_frame():
    assert main_thread_frames(HEADER + "Thread 0x7f00 (active)\n    train (toolkit/train/worker.py:103)\n")
    assert not main_thread_frames(HEADER)


def test_a_stopped_rank_blames_its_node_and_a_waiting_one_does_not(tmp_path, monkeypatch):
    """What the launcher records of each hung rank (toolkit/launch/workers.py): a stopped process
    hangs by itself, a sleeping one may be waiting on a peer."""
    from toolkit.launch.workers import record_hung
    from toolkit.runs.layout import RunLayout

    monkeypatch.setenv("FT_WATCH_START", "3")
    monkeypatch.setenv("SLURMD_NODENAME", "node2")
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    workers = {rank: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for rank in (0, 1)}
    try:
        workers[1].send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while process_state(workers[1].pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        record_hung(RunLayout(tmp_path), "host", {0: "no progress for 12 s", 1: "no progress for 12 s"}, workers)
    finally:
        for process in workers.values():
            process.kill()
            process.wait()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["node"], e["rank"], e["start"], e["job"]) for e in events] == [
        ("rank_hung", "node2", 0, 3, "41"), ("rank_hung", "node2", 1, 3, "41")]
    assert events[0]["blamed"] is None and events[1]["blamed"].startswith("stopped")
