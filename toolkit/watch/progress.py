"""Each rank's progress, told to its node's launcher through a pipe, and the rule that calls a rank
hung. A worker writes one short line per step ("step 12"), and around the long phases where no
step advances ("save 12" while checkpointing, "eval 0" measuring the base model before the first
step, "export 120" and "eval 120" at the end). Writes never block: a
launcher that stopped reading never slows training.

A rank is hung when its step is late by max(hang_factor x its median step time over its last
STEPS_KEPT steps, LONGEST_FACTOR x its longest since the start, hang_floor) seconds: the bound follows the run's own
step times (a run whose steps now and then take long, a logging step's host synchronisation or a
checkpoint's background write, gets room for those), and the floor only keeps a run of very short
steps from being called hung for a pause of a few seconds. Before its first step, and during a
save, the export or the evaluation, the limit is startup_timeout.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from toolkit.recipe.schema import WatchdogSpec

PROGRESS_FD = "FT_PROGRESS_FD"
PHASES = {"step", "save", "export", "eval"}
LONGEST_FACTOR = 3.0
STEPS_KEPT = 50


class Reporter:
    """The worker's end: silent when the worker was not started by a launcher that listens."""

    def __init__(self) -> None:
        self.fd = int(os.environ[PROGRESS_FD]) if os.environ.get(PROGRESS_FD, "").isdigit() else None
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.set_blocking(self.fd, False)

    def report(self, phase: str, step: int) -> None:
        if self.fd is None:
            return
        try:
            os.write(self.fd, f"{phase} {step}\n".encode())
        except BlockingIOError:  # the pipe is full: the launcher reads late, training goes on
            pass
        except OSError:
            self.fd = None  # the launcher is gone


@dataclass(frozen=True)
class HangRule:
    hang_factor: float
    hang_floor: float
    startup_timeout: float

    @classmethod
    def of(cls, watchdog: WatchdogSpec) -> HangRule:
        return cls(watchdog.hang_factor, watchdog.hang_floor, watchdog.startup_timeout)


@dataclass
class RankProgress:
    since: float  # when the rank started, entered its current phase, or reached its current step
    phase: str = "start"
    step: int = -1
    intervals: deque = field(default_factory=lambda: deque(maxlen=STEPS_KEPT))
    longest: float = 0.0  # of every step of this start: a slow step that comes back rarely is not forgotten

    def report(self, phase: str, step: int, now: float) -> None:
        """A step's time counts only between two steps (a save, or the start, is not a step)."""
        if phase == "step" and self.phase == "step" and step > self.step:
            self.intervals.append(now - self.since)
            self.longest = max(self.longest, now - self.since)
        self.phase, self.step, self.since = phase, step, now

    def limit(self, rule: HangRule) -> float:
        if self.phase != "step" or not self.intervals:
            return rule.startup_timeout
        return max(rule.hang_factor * statistics.median(self.intervals), LONGEST_FACTOR * self.longest,
                   rule.hang_floor)

    def late_by(self, rule: HangRule, now: float) -> float:
        """Seconds past the limit (<= 0: not hung)."""
        return now - self.since - self.limit(rule)


class NodeProgress:
    """The launcher's view of its ranks: fed from their pipes, asked which ranks are hung."""

    def __init__(self, ranks: list[int], rule: HangRule):
        now = time.monotonic()
        self.rule = rule
        self.ranks = {rank: RankProgress(since=now) for rank in ranks}
        self.partial: dict[int, bytes] = {rank: b"" for rank in ranks}

    def feed(self, rank: int, data: bytes, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        lines = (self.partial[rank] + data).split(b"\n")
        self.partial[rank] = lines.pop()[-64:]  # an unfinished line; a runaway one is cut, not kept
        for line in lines:
            phase, _, step = line.decode("ascii", errors="replace").partition(" ")
            if phase in PHASES and step.isdigit():
                self.ranks[rank].report(phase, int(step), now)

    def hung(self, now: float | None = None) -> dict[int, str]:
        """Hung ranks and why, in words."""
        now = time.monotonic() if now is None else now
        found = {}
        for rank, progress in self.ranks.items():
            late = progress.late_by(self.rule, now)
            if late > 0:
                where = "before its first step" if progress.phase == "start" else f"{progress.phase} {progress.step}"
                found[rank] = (f"no progress for {now - progress.since:.0f} s ({where}; "
                               f"limit {progress.limit(self.rule):.0f} s)")
        return found

    def summary(self, most: int = 32) -> dict[str, list]:
        """What the heartbeat carries: each rank's phase and step (the first `most` ranks: a
        heartbeat stays one small datagram however many workers a node runs)."""
        return {str(rank): [p.phase, p.step] for rank, p in list(self.ranks.items())[:most]}
