"""How often a run checkpoints: the recipe's steps and minutes, and `checkpoint.every_minutes: auto`
(Cadence, at the end, is the one owner of the decision).

Young (1974) and Daly (2006): with a save costing training C seconds and a failure every M seconds
on average, the interval that loses the least time to saves and to work redone after failures is

    T = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + C / 18M) - C      (C < M/2; else T = M)

C is measured as the run goes: training's pause per save (a snapshot, with asynchronous saves). An
interval shorter than the background write would only queue saves behind it, so T is never below the
write's time, nor below MIN_INTERVAL_S. M is the job's, estimated from the cluster's mean time between
failures per node (profile `node_mtbf_hours`) over the job's nodes, counted as one failure's worth of
prior, and this run's own faults over its wall clock so far: M = (prior + wall) / (1 + faults). One
early fault then halves M, it does not collapse it. Before the first save is measured, the first
save comes after FIRST_INTERVAL_S. No torch here: `ft recipe explain` shows the same numbers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

# Published interruption rates of large training clusters: Llama 3 405B saw 419 unexpected
# interruptions in 54 days on 16,384 GPUs (2,048 nodes), one per ~6,300 node-hours. ft assumes
# somewhat worse for clusters it knows nothing about.
DEFAULT_NODE_MTBF_HOURS = 5000.0
FIRST_INTERVAL_S = 600.0
MIN_INTERVAL_S = 60.0  # a save costs more than its pause (the write, the upload): never more often


class CadenceSite(BaseModel):
    """The cadence's part of a cluster profile (toolkit/cluster/profile.py)."""
    model_config = ConfigDict(extra="forbid")

    # Mean time between failures of one node, for `checkpoint.every_minutes: auto` (the site's own
    # record, if it keeps one; the default follows published large-cluster interruption rates).
    node_mtbf_hours: float = Field(DEFAULT_NODE_MTBF_HOURS, gt=0)


def daly_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum checkpoint interval, in seconds of work between saves."""
    if cost_s <= 0:
        return 0.0
    if cost_s >= mtbf_s / 2:
        return mtbf_s
    ratio = cost_s / (2 * mtbf_s)
    return math.sqrt(2 * cost_s * mtbf_s) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost_s


@dataclass(frozen=True)
class AutoCadence:
    job_mtbf_hours: float  # the prior: the profile's node MTBF over the job's nodes (derived at render)

    def mtbf_s(self, faults: int = 0, observed_s: float = 0.0) -> tuple[float, str]:
        """The job's mean time between failures, and where it came from."""
        prior = self.job_mtbf_hours * 3600
        if not faults:
            return prior, "the cluster's node MTBF over the job's nodes"
        return ((prior + max(observed_s, 0.0)) / (1 + faults),
                f"the cluster's rate and this run's {faults} fault(s) in {observed_s / 3600:.2f} h")

    def interval_s(self, cost_s: float | None, write_s: float, faults: int = 0, observed_s: float = 0.0) -> float:
        if cost_s is None:
            return FIRST_INTERVAL_S
        mtbf, _ = self.mtbf_s(faults, observed_s)
        return max(daly_interval_s(max(cost_s, 0.0), mtbf), write_s, MIN_INTERVAL_S)

    def describe(self, cost_s: float | None, write_s: float, faults: int = 0, observed_s: float = 0.0) -> str:
        interval = self.interval_s(cost_s, write_s, faults, observed_s)
        if cost_s is None:
            return f"every {interval / 60:.1f} min until a save is measured"
        mtbf, source = self.mtbf_s(faults, observed_s)
        bound = (" (the background write's time: saves never queue)" if interval == write_s
                 else " (ft's shortest interval)" if interval == MIN_INTERVAL_S else "")
        return (f"every {interval / 60:.1f} min{bound}: Young/Daly for a save costing training {cost_s:.2f} s "
                f"and a failure every {mtbf / 3600:.1f} h ({source})")


@dataclass
class Cadence:
    """When a run saves, decided here alone: every `every_steps` steps, and on the clock every
    `every_s` seconds or, with `auto`, Young/Daly's interval from the saves measured so far. The
    recipe's checkpoint.every_steps and every_minutes (a number, "auto", or unset: no clock) make it
    (`of`); the training loop only asks it, and saves at the last step and on a stop besides."""

    every_steps: int | None = None
    every_s: float | None = None
    auto: AutoCadence | None = None
    history: tuple[int, float] = (0, 0.0)  # the run's (faults, wall seconds) before this start
    started: float = field(default_factory=time.monotonic)

    @classmethod
    def of(cls, every_steps: int | None, every_minutes: float | str | None, job_mtbf_hours: float | None,
           history: Callable[[], tuple[int, float]] = lambda: (0, 0.0)) -> Cadence:
        """From the recipe's two settings. `history` (read only for auto) is what the run met so far,
        over its requeues and restarts."""
        if every_minutes == "auto":
            return cls(every_steps, auto=AutoCadence(job_mtbf_hours or DEFAULT_NODE_MTBF_HOURS), history=history())
        return cls(every_steps, every_s=float(every_minutes) * 60 if every_minutes else None)

    def steps_due(self, step: int) -> bool:
        return bool(self.every_steps and step % self.every_steps == 0)

    @property
    def on_clock(self) -> bool:
        """Whether any save comes by the clock (the recipe's minutes, or auto)."""
        return self.auto is not None or bool(self.every_s)

    def seen(self) -> tuple[int, float]:
        """The run's faults and wall clock so far: its history, and this start's time since."""
        faults, wall = self.history
        return faults, wall + time.monotonic() - self.started

    def interval_s(self, save_cost_s: float | None, write_s: float) -> float:
        """Seconds between saves on the clock (0: none): the recipe's, or Young/Daly's from the save
        cost measured so far."""
        if self.auto is None:
            return self.every_s or 0.0
        return self.auto.interval_s(save_cost_s, write_s, *self.seen())

    def clock_due(self, since_last_save_s: float, save_cost_s: float | None, write_s: float) -> bool:
        interval = self.interval_s(save_cost_s, write_s)
        return interval > 0 and since_last_save_s >= interval

    def describe(self, save_cost_s: float | None, write_s: float) -> str | None:
        """The auto interval in words (None where the recipe fixed it)."""
        return self.auto.describe(save_cost_s, write_s, *self.seen()) if self.auto else None
