"""How far a run is, from rank 0's metrics.jsonl: the newest step, its loss, and the rates over the
newest start's last steps. Read by the run's Prometheus exporter and by `ft status --watch`; reads
the file's tail only (a run's file grows for days). No torch here."""

from __future__ import annotations

import contextlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from toolkit.base.shared_dirs import open_regular

WINDOW = 20  # steps the rates are taken over
TAIL_BYTES = 16384  # enough for WINDOW metrics lines


def number(value) -> float | None:
    """A finite number, or None (a file's null, NaN, a string, a 400-digit integer)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        value = float(value)
    except OverflowError:
        return None
    return value if math.isfinite(value) else None


def tail_lines(path: Path, size: int = TAIL_BYTES) -> list[dict]:
    """The last complete JSON lines of a file, read from its end."""
    try:
        with open_regular(path) as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(handle.tell() - size, 0))
            data = handle.read()
    except OSError:
        return []
    lines = []
    for raw in data.splitlines()[1:] if len(data) >= size else data.splitlines():
        with contextlib.suppress(ValueError, RecursionError):  # a torn line, or one nested without end
            entry = json.loads(raw)
            if isinstance(entry, dict):
                lines.append(entry)
    return lines


def restarted(before: dict, after: dict) -> bool:
    """Whether a new start began between two metrics lines: a start resumes from a checkpoint (the
    step goes back) and counts its tokens afresh."""
    return after["step"] <= before["step"] or (number(after.get("tokens")) or 0) < (number(before.get("tokens")) or 0)


def since_last_restart(lines: list[dict]) -> list[dict]:
    """The lines after the last restart: a window over a restart would mix two starts (a negative rate)."""
    for i in range(len(lines) - 1, 0, -1):
        if restarted(lines[i - 1], lines[i]):
            return lines[i:]
    return lines


@dataclass(frozen=True)
class Progress:
    step: float
    time: float  # when the newest step ended (Unix time)
    loss: float | None
    learning_rate: float | None
    tokens: float  # trained on in the newest start
    tokens_per_second: float | None  # over the newest start's last WINDOW steps
    step_seconds: float | None
    total_steps: float | None  # what the run plans, once its worker knows (the data's size)

    def eta_seconds(self) -> float | None:
        if self.total_steps is None or self.step_seconds is None:
            return None
        return max(self.total_steps - self.step, 0) * self.step_seconds


def read_progress(metrics: Path) -> Progress | None:
    """None before the first step (or for a file that holds no step line)."""
    lines = [line for line in tail_lines(metrics) if number(line.get("step")) is not None
             and number(line.get("time")) is not None]
    if not lines:
        return None
    newest, window = lines[-1], since_last_restart(lines)[-WINDOW:]
    steps = newest["step"] - window[0]["step"]
    seconds = newest["time"] - window[0]["time"]
    tokens = (number(newest.get("tokens")) or 0) - (number(window[0].get("tokens")) or 0)
    return Progress(step=number(newest["step"]), time=number(newest["time"]), loss=number(newest.get("loss")),
                    learning_rate=number(newest.get("lr")), tokens=number(newest.get("tokens")) or 0,
                    tokens_per_second=tokens / seconds if seconds > 0 and steps > 0 else None,
                    step_seconds=seconds / steps if steps > 0 and seconds >= 0 else None,
                    total_steps=number(newest.get("of")))
