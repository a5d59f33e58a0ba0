"""Where a run's time went, from what its job wrote: the watchdog's events (events.jsonl: each start,
fault and decision) and rank 0's metrics (metrics.jsonl: one stamped line per step).

    productive  steps done for the first time
    redone      steps trained again after a fault (the work lost since the last checkpoint)
    starting    each start until its first step: model load, data, DeepSpeed init, checkpoint load
                (restarting: the part of it spent by the starts a fault made)
    recovering  from the last step before a fault to the next start: detection, stopping the
                step, the requeue, the backoff
    other       the rest: checkpoint saves, the export

Goodput is productive time over the wall time since the first start.
"""

from __future__ import annotations

import bisect
import json
import os
import time
from pathlib import Path

from toolkit.base.shared_dirs import open_regular
from toolkit.runs.layout import RunLayout

FAULTS = {"node_lost", "restart", "node_silent"}
EARLIEST, LATEST = 1e9, 1e11  # plausible Unix times (2001 to the year 5138): anything else is torn or forged
MAX_LINES = 1_000_000


def record(run_dir: Path, event: str, **fields) -> None:
    """One event of the run's timeline (the watchdog's, the job's): a JSON line."""
    line = json.dumps({"time": round(time.time(), 3), "job": os.environ.get("SLURM_JOB_ID", ""), "event": event,
                       **fields})
    descriptor = os.open(RunLayout(run_dir).events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(descriptor, "a") as handle:
        handle.write(line + "\n")


def add_span(episode: dict, since: float, to: float) -> None:
    """A span of time an episode cost, joined to its last one where they touch (steps in a row)."""
    spans = episode["spans"]
    if spans and abs(spans[-1][1] - since) < 1e-9:
        spans[-1][1] = to
    else:
        spans.append([since, to])


def plausible_time(value) -> bool:
    return type(value) in (int, float) and EARLIEST <= value <= LATEST  # False for NaN, inf and huge ints


def read_lines(path: Path, required: dict[str, type | tuple]) -> list[dict]:
    """JSON lines with the fields required; torn or foreign lines are skipped."""
    try:
        with open_regular(path, text=True) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return []
    entries = []
    for line in lines:
        try:
            entry = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(entry, dict) and all(isinstance(entry.get(k), kind) for k, kind in required.items()) \
                and ("time" not in required or plausible_time(entry["time"])):
            entries.append(entry)
        if len(entries) >= MAX_LINES:
            break
    return entries


def timeline(run_dir: Path, now: float | None = None) -> dict | None:
    """The run's time accounts, or None before the watchdog recorded a start."""
    events = sorted(read_lines(RunLayout(run_dir).events, {"time": (int, float), "event": str}),
                    key=lambda e: e["time"])
    metrics = sorted((m for m in read_lines(RunLayout(run_dir).metrics, {"time": (int, float), "step": int})
                      if 0 <= m["step"] < 10**12), key=lambda m: m["time"])
    starts = [e["time"] for e in events if e["event"] == "start"]
    if not starts:
        return None
    ended = events[-1]["event"] == "end" and events[-1].get("code") == 0
    end = max(events[-1]["time"] if ended else (now or time.time()), starts[0])
    wall = max(end - starts[0], 1e-9)
    metrics = [m for m in metrics if starts[0] <= m["time"] <= end]  # clocks of other nodes may disagree
    # Each fault episode (the faults between two starts: a node lost, then its ranks restarted) and
    # the time it cost: the wait from its last step to the next start, that start, and the steps it
    # redid. Usage refunds an episode where Slurm's own node events agree (toolkit/account/usage.py).
    episodes, episode_of_start, current = [], {}, None
    stamps = [m["time"] for m in metrics]
    for event in events:
        if event["event"] in FAULTS:
            if current is None:
                # The start the fault ended: the one before it (a spare's start is stamped with the
                # fault's very time); detection counts from its last step before the fault.
                began = starts[max(bisect.bisect_left(starts, event["time"]) - 1, 0)]
                last = bisect.bisect_right(stamps, event["time"]) - 1
                current = {"time": event["time"], "events": [], "nodes": [], "spans": [],
                           "from": max(stamps[last], began) if last >= 0 else event["time"]}
                episodes.append(current)
            current["events"].append(event["event"])
            if isinstance(event.get("node"), str) and event["node"] not in current["nodes"]:
                current["nodes"].append(event["node"])
        elif event["event"] == "took_over" and current is not None:
            # A successor took over the running step (toolkit/job/successor.py): training never
            # stopped, and the loss cost nothing (no span: no time to account, nor to refund).
            current.pop("from")
            current = None
        elif event["event"] == "start" and current is not None:
            current["spans"].append([current.pop("from"), event["time"]])  # recovering
            episode_of_start[event["time"]] = current
            current = None
    if current is not None:
        current["spans"].append([current.pop("from"), end])
    recovering = sum(to - since for episode in episodes for since, to in episode["spans"])
    productive = redone = starting = restarting = 0.0
    best, previous = 0, None
    for entry in metrics:
        began = starts[max(bisect.bisect_right(starts, entry["time"]) - 1, 0)]
        episode = episode_of_start.get(began)  # the fault this start recovers from, if one
        if previous is None or began > previous["time"]:  # a start's first step: the wait was starting
            starting += entry["time"] - began
            if episode is not None:
                restarting += entry["time"] - began
                add_span(episode, began, entry["time"])
        elif entry["step"] > best:
            productive += entry["time"] - previous["time"]
        else:
            redone += entry["time"] - previous["time"]
            if episode is not None:  # redone after a preemption or a time limit is no fault's cost
                add_span(episode, previous["time"], entry["time"])
        best, previous = max(best, entry["step"]), entry
    faults = [{key: value for key, value in e.items() if key != "job"} for e in events if e["event"] in FAULTS]
    last_end = next((e for e in reversed(events) if e["event"] == "end"), None)
    accounted = productive + redone + starting + recovering
    return {"wall_s": round(wall, 1), "productive_s": round(productive, 1), "redone_s": round(redone, 1),
            "starting_s": round(starting, 1), "restarting_s": round(restarting, 1),
            "recovering_s": round(recovering, 1),
            "episodes": [episode | {"spans": [[round(a, 3), round(b, 3)] for a, b in episode["spans"][-1000:]]}
                         for episode in episodes[-1000:]],
            "other_s": round(max(wall - accounted, 0.0), 1), "goodput": round(min(productive / wall, 1.0), 3),
            "starts": len(starts), "faults": faults, "finished": ended,
            # The newest end and the start it ended (what a user error cost: toolkit/account/usage.py).
            "last_end": None if last_end is None else {
                "time": last_end["time"], "code": last_end.get("code"),
                "began": starts[max(bisect.bisect_right(starts, last_end["time"]) - 1, 0)]}}
