"""`ft status RUN --watch`: a live terminal view of a run, redrawn in place (rich's Live) every few
seconds until its job ends: the state, the newest step with its loss, tokens/s and ETA, the
checkpoints, the restarts and faults so far, and the job's nodes with Slurm's view of their health.

Everything comes from what `ft status` reads (Slurm, the run's files on the shared filesystem):
nothing reaches into the job, and nothing here imports the training stack."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from datetime import datetime

from toolkit.checkpoint.status import summary_line as checkpoint_summary
from toolkit.cli.output import plain
from toolkit.runs.layout import RunLayout
from toolkit.runs.progress import Progress, read_progress
from toolkit.runs.status import RunStatus

STATE_COLOURS = {"RUNNING": "green", "COMPLETED": "green", "PENDING": "yellow", "REQUEUED": "yellow",
                 "FAILED": "red", "NODE_FAIL": "red", "CANCELLED": "magenta", "TIMEOUT": "red"}


def following(current: RunStatus) -> bool:
    """While the run has a job Slurm knows that has not finished (a requeue is not an end)."""
    return current.job is not None and not current.job.finished


def duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds) or abs(seconds) > 1e9:
        return "-"
    seconds = int(max(seconds, 0))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def progress_table(progress: Progress | None, now: float):
    from rich.table import Table

    table = Table(show_header=True, box=None, pad_edge=False)
    for column in ("step", "loss", "tokens/s", "s/step", "last step", "ETA"):
        table.add_column(column, justify="right")
    if progress is None:
        table.add_row("-", "-", "-", "-", "-", "-")
        return table
    of = f"/{progress.total_steps:.0f}" if progress.total_steps else ""
    table.add_row(f"{progress.step:.0f}{of}", f"{progress.loss:.4f}" if progress.loss is not None else "-",
                  f"{progress.tokens_per_second:,.0f}" if progress.tokens_per_second is not None else "-",
                  f"{progress.step_seconds:.2f}" if progress.step_seconds is not None else "-",
                  f"{duration(now - progress.time)} ago", duration(progress.eta_seconds()))
    return table


def nodes_table(nodes: dict):
    """The job's nodes as Slurm sees them (toolkit/slurm/nodes.NodeState)."""
    from rich.table import Table

    table = Table(show_header=True, box=None, pad_edge=False)
    for column in ("node", "state", "reason"):
        table.add_column(column)
    for node in sorted(nodes.values(), key=lambda n: n.name):
        colour = "green" if node.up else "red" if node.state.startswith(("down", "drain", "fail")) else "yellow"
        table.add_row(plain(node.name), f"[{colour}]{plain(node.state)}[/]", plain(node.reason))
    return table


def frame(current: RunStatus, nodes: dict, now: float, updated: float):
    """One screen of the view (a rich renderable)."""
    from rich.console import Group
    from rich.text import Text

    state = current.state
    job = current.job
    header = Text.from_markup(
        f"run [bold]{plain(current.run.run_id)}[/]  [{STATE_COLOURS.get(state, 'white')}]{plain(state)}[/]"
        + (f"  job {plain(job.job_id)}" if job else "")
        + (f"  ({plain(job.reason)})" if job and job.reason and job.reason != "None" else ""))
    parts = [header, progress_table(read_progress(RunLayout(current.run_dir).metrics), now)]
    if current.checkpoints and (where := checkpoint_summary(current.checkpoints, now)):
        parts.append(Text.from_markup(f"checkpoints: {plain(where)}"))
    if current.timeline:
        spent = current.timeline
        restarts = max(spent["starts"] - 1, 0)
        parts.append(Text(f"goodput {spent['goodput']:.0%} of {duration(spent['wall_s'])}; "
                          f"{restarts} restart{'s' * (restarts != 1)}, {len(spent['faults'])} "
                          f"fault{'s' * (len(spent['faults']) != 1)}"))
        for fault in spent["faults"][-3:]:  # the newest: `ft status RUN` lists them all
            when = datetime.fromtimestamp(fault["time"]).strftime("%H:%M:%S")  # a plausible time (timeline.py)
            what = fault.get("reason") or fault.get("after") or ""
            parts.append(Text.from_markup(f"  {when} {plain(fault['event'])} {plain(fault.get('node', ''))} "
                                          f"{plain(what)}".rstrip()))
    if nodes:
        parts.append(nodes_table(nodes))
    parts.append(Text.from_markup(f"[dim]updated {datetime.fromtimestamp(updated).strftime('%H:%M:%S')}; "
                                  f"Ctrl-C leaves (the run goes on)[/]"))
    return Group(*parts)


def job_nodes(current: RunStatus, read_nodes: Callable[[str], dict]) -> dict:
    job = current.job
    if job is None or not job.nodes or job.state not in {"RUNNING", "COMPLETING"}:
        return {}
    try:
        return read_nodes(job.nodes)
    except Exception:  # noqa: BLE001 - Slurm slow or away: the view goes on without the nodes
        return {}


def slurm_nodes(nodelist: str) -> dict:
    from toolkit.slurm import commands
    from toolkit.slurm.nodes import node_states

    return node_states(commands.run, nodes=nodelist, timeout=5)


def watch(read_status: Callable[[], RunStatus], interval: float, console,
          read_nodes: Callable[[str], dict] = slurm_nodes) -> RunStatus:
    """Redraw until the run's job ends; returns the last status."""
    from rich.live import Live

    current = read_status()
    with Live(frame(current, job_nodes(current, read_nodes), time.time(), time.time()), console=console,
              auto_refresh=False, transient=False) as live:
        while following(current):
            time.sleep(interval)
            current = read_status()
            now = time.time()
            live.update(frame(current, job_nodes(current, read_nodes), now, now), refresh=True)
    if not console.is_terminal:  # rich ends the last frame with a newline on a terminal only
        console.line()
    return current
