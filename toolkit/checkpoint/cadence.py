"""How often to checkpoint when the recipe says `checkpoint.every_minutes: auto`.

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
from dataclasses import dataclass

# Published interruption rates of large training clusters: Llama 3 405B saw 419 unexpected
# interruptions in 54 days on 16,384 GPUs (2,048 nodes), one per ~6,300 node-hours. ft assumes
# somewhat worse for clusters it knows nothing about.
DEFAULT_NODE_MTBF_HOURS = 5000.0
FIRST_INTERVAL_S = 600.0
MIN_INTERVAL_S = 60.0  # a save costs more than its pause (the write, the upload): never more often


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
