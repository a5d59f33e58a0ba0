"""Reading a py-spy dump: a dump whose main thread came without frames (py-spy caught it between
two, as seen on the lab) is asked for again; one with them is kept."""

from __future__ import annotations

from toolkit.watch.stacks import main_thread_frames

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
