"""`ft report RUN`: one self-contained HTML page of a run (report.html.j2 beside this file): its
loss and throughput curves, the starts and faults over time, where the time went, its data, its
cost. Read from the run's own files (what `ft status` reads); no torch, no network."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

from toolkit.base.shared_dirs import open_regular
from toolkit.report.charts import Marker, Span, breakdown_bar, line_chart, timeline_chart
from toolkit.runs.layout import RunLayout
from toolkit.runs.progress import number, restarted
from toolkit.runs.status import RunStatus
from toolkit.runs.timeline import plausible_time, read_lines

SMOOTH = 10  # steps the throughput curve is averaged over
MAX_POINTS = 2000  # a week-long run's curve, thinned to what a page can draw


def thinned(points: list, most: int = MAX_POINTS) -> list:
    if len(points) <= most:
        return points
    every = len(points) / most
    return [points[int(i * every)] for i in range(most)] + [points[-1]]


def metrics_entries(path: Path):
    """Each sound line of a metrics file, read a line at a time."""
    try:
        with open_regular(path, text=True) as handle:
            for raw in handle:
                try:
                    entry = json.loads(raw)
                except (ValueError, RecursionError):
                    continue
                if isinstance(entry, dict) and type(entry.get("step")) is int and 0 <= entry["step"] < 10**12 \
                        and plausible_time(entry.get("time")):
                    yield entry
    except OSError:
        return


def step_lines(layout: RunLayout, most: int = 2 * MAX_POINTS) -> list[dict]:
    """The metrics lines, read whole however long the run (a line at a time), thinned as they come
    to at most `most` (every 2nd, 4th, ... line: a curve keeps its shape), the newest always kept."""
    kept: list[dict] = []
    stride, newest = 1, None
    for index, entry in enumerate(metrics_entries(layout.metrics)):
        newest = entry
        if index % stride == 0:
            kept.append(entry)
            if len(kept) > most:
                kept, stride = kept[::2], stride * 2
    if newest is not None and (not kept or kept[-1] is not newest):
        kept.append(newest)
    return kept


def by_start(lines: list[dict]) -> list[list[dict]]:
    """The lines of each start (progress.restarted tells where one begins)."""
    starts: list[list[dict]] = []
    for line in lines:
        if not starts or restarted(starts[-1][-1], line):
            starts.append([])
        starts[-1].append(line)
    return starts


def throughput(start: list[dict]) -> list[tuple[float, float]]:
    """Tokens per second against the step, over SMOOTH steps of one start."""
    curve = []
    for index, line in enumerate(start[1:], 1):
        first = start[max(index - SMOOTH, 0)]
        if line["time"] > first["time"]:
            tokens = (number(line.get("tokens")) or 0) - (number(first.get("tokens")) or 0)
            curve.append((line["step"], tokens / (line["time"] - first["time"])))
    return curve


def restart_markers(starts: list[list[dict]]) -> list[Marker]:
    return [Marker(after[0]["step"], f"restart: resumed at step {after[0]['step']} after step {before[-1]['step']}")
            for before, after in zip(starts, starts[1:], strict=False)]


def starts_and_faults(layout: RunLayout) -> tuple[list[Span], list[Marker], float | None]:
    events = sorted(read_lines(layout.events, {"time": (int, float), "event": str}), key=lambda e: e["time"])
    starts = [e for e in events if e["event"] == "start"]
    if not starts:
        return [], [], None
    spans = []
    for start in starts:
        following = [e for e in events if e["time"] > start["time"] and e["event"] in ("start", "end")]
        end = following[0]["time"] if following else time.time()
        nodes = ", ".join(map(str, start["nodes"])) if isinstance(start.get("nodes"), list) else ""
        spans.append(Span(f"job {start.get('job', '?')}", start["time"], end,
                          f"start {start.get('start', '?')} on {nodes}"))
    faults = [Marker(e["time"], f"{e['event']}: {e.get('node', '')} {e.get('reason') or e.get('after') or ''}".strip())
              for e in events if e["event"] in ("node_lost", "restart", "node_silent")]
    return spans, faults, starts[0]["time"]


def data_report(path: Path) -> list[dict]:
    """`ft submit`'s data checks, one entry per file; what is not such an entry is left out."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return []
    return [entry for entry in found if isinstance(entry, dict)] if isinstance(found, list) else []


def when(stamp) -> str:
    return datetime.fromtimestamp(stamp).strftime("%Y-%m-%d %H:%M:%S") if plausible_time(stamp) else "-"


def context(current: RunStatus, price_per_gpu_hour: float = 0.0) -> dict:
    layout = RunLayout(current.run_dir)
    lines = step_lines(layout)
    starts = by_start(lines)
    spans, faults, t0 = starts_and_faults(layout)
    spent = current.timeline
    summary = current.summary or {}
    gpu_hours = number(summary.get("gpu_hours"))
    shares = {"training": spent["productive_s"], "redone after faults": spent["redone_s"],
              "starting": spent["starting_s"], "recovering": spent["recovering_s"],
              "other": spent["other_s"]} if spent else {}
    return {
        "run": current.run, "state": current.state, "job": current.job, "run_dir": str(current.run_dir),
        "generated": datetime.now().strftime("%Y-%m-%d %H:%M"),
        "steps": lines[-1]["step"] if lines else None, "final_loss": number(lines[-1].get("loss")) if lines else None,
        "loss_chart": line_chart([thinned([(m["step"], m["loss"]) for m in start if number(m.get("loss")) is not None])
                                  for start in starts], "step", "loss", restart_markers(starts)),
        "throughput_chart": line_chart([thinned(throughput(start)) for start in starts], "step", "tokens/s",
                                       restart_markers(starts), y_from_zero=True),
        "timeline_chart": timeline_chart(spans, faults, t0) if t0 is not None else None,
        "faults": spent["faults"] if spent else [], "spent": spent,
        "breakdown_chart": breakdown_bar(shares) if shares else None,
        "attempts": current.attempts, "summary": summary,
        "cost": gpu_hours * price_per_gpu_hour if gpu_hours is not None and price_per_gpu_hour else None,
        "price": price_per_gpu_hour, "gpu_hours": gpu_hours,
        "data": data_report(layout.data_report),
        "checkpoints": current.checkpoints,
        "smooth": SMOOTH,
        "when": when,
    }


def render(current: RunStatus, price_per_gpu_hour: float = 0.0) -> str:
    from jinja2 import Environment, FileSystemLoader, select_autoescape

    # Undefined (not StrictUndefined): a field missing from a file edited by hand shows as nothing.
    environment = Environment(loader=FileSystemLoader(Path(__file__).parent),
                              autoescape=select_autoescape(["html", "j2"]), trim_blocks=True, lstrip_blocks=True)
    return environment.get_template("report.html.j2").render(**context(current, price_per_gpu_hour))
