"""`ft submit`, `ft ls`, `ft status`, `ft logs`, `ft cancel`: runs as a user sees them."""

from __future__ import annotations

import codecs
import contextlib
import functools
import json
import os
import stat
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import typer

from toolkit.base.errors import FtError
from toolkit.checkpoint.status import summary_line as checkpoint_summary
from toolkit.cli.live import STATE_COLOURS
from toolkit.cli.output import console, err_console, plain, print_json, task_spinner
from toolkit.cluster.broker import Preference
from toolkit.runs.layout import RunLayout


def _store(cluster: str | None):
    from toolkit.cluster.profile import load_profile
    from toolkit.runs.store import RunStore

    return RunStore.for_shared_root(load_profile(cluster).shared_root)


def _cost(current) -> str:
    """What the run cost at its cluster's price per GPU-hour (when the profile has one)."""
    from toolkit.cluster.profile import ProfileError, load_profile

    try:
        price = load_profile(current.run.cluster).price_per_gpu_hour
    except ProfileError:
        return ""
    return f" (about ${current.summary['gpu_hours'] * price:,.2f} at ${price}/GPU-hour)" if price else ""


def _fault_line(fault: dict) -> str:
    """One fault of the run's timeline, as a sentence."""
    when = datetime.fromtimestamp(fault["time"]).strftime("%H:%M:%S")  # a plausible time (timeline.py)
    if fault["event"] == "node_lost":
        by = f", reported by {plain(fault['reported_by'])}" if fault.get("reported_by") else ""
        down = ", marked DOWN" if fault.get("marked_down") else ", drained" if fault.get("drained_by_ft") else ""
        return f"{when} node {plain(fault.get('node', '?'))} lost ({plain(fault.get('reason', ''))}){down}{by}"
    if fault["event"] == "restart":
        return f"{when} restart {plain(fault.get('restart', '?'))} after {plain(fault.get('after', '?'))}"
    what = ", ".join(f"{key} {plain(value)}" for key, value in fault.items() if key not in ("time", "event"))
    return f"{when} {plain(fault['event'])}: {what}"


def _coloured(state: str) -> str:
    return f"[{STATE_COLOURS.get(state, 'white')}]{state}[/]"


def submit(
    recipe: Path = typer.Argument(..., help="Recipe file (YAML)."),
    cluster: str = typer.Option(None, "--cluster", "-c",
                                help="Cluster profile; auto: the broker's choice (ft plan shows the options)."),
    prefer: Preference = typer.Option(Preference.cheapest, "--prefer", help="With --cluster auto: cheapest "
                                      "(starting within --max-wait) or soonest."),
    max_wait: float = typer.Option(30.0, "--max-wait", min=0, help="With --cluster auto: minutes the cheapest "
                                   "may wait to start before the soonest is taken instead."),
    idempotency_key: str = typer.Option(None, "--idempotency-key",
                                        help="Submit at most once per key: a repeat returns the first run."),
    preflight: bool = typer.Option(False, "--preflight",
                                   help="Only check the allocation (rendezvous, GPUs, shared filesystem)."),
    skip_validation: bool = typer.Option(False, "--skip-validation",
                                         help="Submit even when the data checks find errors."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
    wait: bool = typer.Option(False, "--wait", help="Follow the run until its job ends; exit 1 unless it completed."),
) -> None:
    """Validate a recipe and its data, render its script and submit it as a gang-scheduled job."""
    from toolkit.submission import submit as submit_run

    with task_spinner("submit") as step:
        step("weighing the clusters" if cluster == "auto" else "validating and rendering")
        submission = submit_run(recipe, cluster, idempotency_key, mode="preflight" if preflight else "train",
                                skip_validation=skip_validation, prefer=prefer, max_wait_s=max_wait * 60)
    run = submission.run
    layout = RunLayout(submission.run_dir)
    plan = json.loads(layout.plan.read_text()) if cluster == "auto" and layout.plan.is_file() else None
    if as_json:
        print_json({"run_id": run.run_id, "job_id": run.latest_job, "run_dir": str(submission.run_dir),
                    "created": submission.created, "warnings": submission.warnings,
                    **({"plan": plan} if plan else {})})
        return
    if plan:
        chosen = plan["chosen"]
        console.print(f"placed on [bold]{plain(chosen['cluster'])}[/], tier {plain(chosen['tier'])}: "
                      f"{plain(plan['why'])}")
    for warning in submission.warnings:
        err_console.print(f"[yellow]warning:[/] {plain(warning)}", soft_wrap=True)
    verb = "submitted" if submission.created else "already submitted (same idempotency key)"
    console.print(f"run [bold]{plain(run.run_id)}[/] {verb}: job {plain(run.latest_job)}")
    console.print(f"  run directory {plain(submission.run_dir)}")
    console.print(f"  follow it with: ft status {plain(run.run_id)}   ft logs {plain(run.run_id)} -f")
    if wait:
        _wait_for(run.run_id, cluster)


def _wait_for(run_id: str, cluster: str | None) -> None:
    """Until the run's job has ended (a requeue is not an end): its state on a spinner, then the verdict."""
    from toolkit.api import run as run_handle

    with task_spinner(f"run {run_id}") as step:
        current = run_handle(run_id, cluster).wait(poll=3, on_state=lambda status: step(status.state))
    if current.state != "COMPLETED":
        err_console.print(f"run {plain(run_id)} ended [bold red]{plain(current.state)}[/]: "
                          f"ft status {plain(run_id)}; ft logs {plain(run_id)}")
        raise typer.Exit(1)
    console.print(f"run {plain(run_id)} [green]COMPLETED[/]: ft status {plain(run_id)}")


def ls(cluster: str = typer.Option(None, "--cluster", "-c"), limit: int = typer.Option(20, "--limit", "-n"),
       as_json: bool = typer.Option(False, "--json")) -> None:
    """List recent runs."""
    from toolkit.runs.status import queued_runs, run_status
    from toolkit.slurm.client import default_client

    store, client = _store(cluster), default_client()
    records = store.list()[:limit]
    queued = queued_runs(client) if any(not record.jobs for record in records) else {}
    statuses = [run_status(store, record.run_id, client, queued) for record in records]
    if as_json:
        print_json([status.to_dict() for status in statuses])
        return
    from rich.table import Table

    table = Table(title=f"runs in {plain(store.root)}", title_justify="left")
    for column in ("run", "state", "job", "tier", "mode", "submitted"):
        table.add_column(column, overflow="fold")  # a run's name whole, to copy into `ft status`
    for status in statuses:
        job_id = status.job.job_id if status.job else status.run.latest_job  # a queued rendered run's too
        table.add_row(plain(status.run.run_id), _coloured(status.state), plain(job_id or "-"),
                      plain(status.tier or "-"), plain(status.run.mode),
                      datetime.fromtimestamp(status.run.created).strftime("%Y-%m-%d %H:%M"))
    console.print(table)


def _evaluation_lines(results: dict | None) -> list[str]:
    """The evaluation after training in a few lines: each set's loss beside the base model's, the
    task metrics, the verdict and every failed gate."""
    if not results:
        return []
    try:
        base, trained = results.get("base") or {}, results["adapter"]
        shown = []
        for split, found in trained.items():
            if not found:
                continue
            before = (base.get(split) or {}).get("loss")
            shown.append(f"{split.replace('_', '-')} loss {found['loss']:.4f}"
                         + (f" (base {before:.4f})" if before is not None else " (base not measured)"))
            for metric, value in (found.get("metrics") or {}).items():
                was = ((base.get(split) or {}).get("metrics") or {}).get(metric)
                shown.append(f"{metric} {value:.3f}" + (f" (base {was:.3f})" if was is not None else ""))
        lines = [f"eval: {', '.join(shown) or 'no data to measure'}",
                 f"eval: {results['state']}: {results['why']}"]
        registry = results.get("registry")
        if isinstance(registry, dict):
            lines.append(f"registry: {registry['name']} version {registry['version'][:12]} {registry['state']}"
                         + (f" ({registry['why']})" if registry.get("why") else "") if "version" in registry
                         else f"registry: not registered ({registry.get('error')})")
    except (AttributeError, KeyError, TypeError, ValueError):  # a file damaged by hand
        return ["eval: the results (eval.json) cannot be read"]
    return lines


def newest_run(store, run_id: str | None) -> str:
    """The run named, or the newest one (a newcomer's `ft status` right after `ft submit`), said so."""
    if run_id:
        return run_id
    records = store.list()
    if not records:
        raise FtError(f"no runs in {store.root} yet", hint="submit one: ft submit RECIPE.yaml")
    typer.echo("(the newest run; `ft ls` lists them all)", err=True)  # stdout stays the run's (--json)
    return records[0].run_id


def status(run_id: str = typer.Argument(None, help="The run (default: the newest one)."),
           cluster: str = typer.Option(None, "--cluster", "-c"),
           as_json: bool = typer.Option(False, "--json"),
           watch: bool = typer.Option(False, "--watch", "-w",
                                      help="Follow the run live (step, loss, ETA, nodes) until its job ends."),
           interval: float = typer.Option(2.0, "--interval", min=0.5, max=3600,
                                          help="Seconds between updates of --watch.")) -> None:
    """Show a run's state (from squeue, then sacct, then the job-completion log), jobs and attempts."""
    from toolkit.runs.status import run_status
    from toolkit.slurm.client import default_client

    if watch and as_json:
        raise FtError("--watch draws a live view for a terminal; --json prints once",
                      hint="use one of them (a script polls `ft status RUN --json`)")
    store, client = _store(cluster), default_client()
    run_id = newest_run(store, run_id)
    if watch:
        from toolkit.cli.live import watch as live_view

        try:
            current = live_view(lambda: run_status(store, run_id, client), interval, console.get())
        except KeyboardInterrupt:  # leaving the view leaves the run alone
            return
    else:
        current = run_status(store, run_id, client)
    if as_json:
        print_json(current.to_dict())
        return
    job = current.job
    console.print(f"run [bold]{plain(run_id)}[/]: {_coloured(current.state)}"
                  + (f" (job {plain(job.job_id)} on {plain(job.nodes or '-')}; state from {job.source})" if job
                     else " (rendered: no job has been submitted with it yet)" if not current.run.jobs else ""))
    if job and job.reason and job.reason != "None":
        console.print(f"  reason: {plain(job.reason)}")
    console.print(f"  run directory {plain(current.run_dir)}", soft_wrap=True)
    if current.tracking:
        console.print(f"  metrics: {plain(current.tracking.get('wandb'))} (W&B {plain(current.tracking.get('mode'))})",
                      soft_wrap=True)  # a path is easier to copy unbroken
    if current.summary:
        done = current.summary
        # The summary is the last start's: after a restart its tokens and time are that start's alone.
        last = " in its last start" if current.timeline and current.timeline["starts"] > 1 else ""
        console.print(f"  done: {done['steps']} steps, final loss {done['final_loss']:.4f}; {done['tokens']} tokens, "
                      f"{done['wall_seconds']} s, {done['gpu_hours']} GPU-hours of training{_cost(current)}{last}; "
                      f"output {plain(done['output'])}", soft_wrap=True)  # lines whole, paths unbroken
    if current.checkpoints and (where := checkpoint_summary(current.checkpoints)):
        console.print(f"  checkpoints: {plain(where)}", soft_wrap=True)
    for line in _evaluation_lines(current.evaluation):
        console.print(f"  {plain(line)}", soft_wrap=True)
    if current.timeline:
        spent = current.timeline
        # A short run without faults is mostly its start: said, so that a low figure does not alarm.
        calm = "" if spent["faults"] else " (no faults: the rest is the start and the saves)"
        console.print(f"  goodput {spent['goodput']:.0%} of {spent['wall_s']:.0f} s since the first start{calm}: "
                      f"training {spent['productive_s']:.0f} s, redone after faults {spent['redone_s']:.0f} s, "
                      f"starting {spent['starting_s']:.0f} s, recovering {spent['recovering_s']:.0f} s, "
                      f"other {spent['other_s']:.0f} s", soft_wrap=True)
        for fault in spent["faults"]:
            console.print(f"  {_fault_line(fault)}", soft_wrap=True)
    from rich.table import Table

    table = Table(title="attempts", title_justify="left")
    for column in ("job", "requeue", "start", "nodes", "started"):
        table.add_column(column)
    for attempt in current.attempts:
        table.add_row(plain(attempt["job_id"]), plain(attempt["restart"]), plain(attempt.get("start", 1)),
                      plain(",".join(map(str, attempt["nodes"]))),
                      datetime.fromtimestamp(attempt["started"]).strftime("%H:%M:%S"))
    if current.attempts:
        console.print(table)


def compare(run_ids: list[str] = typer.Argument(..., help="Two runs or more."),
            cluster: str = typer.Option(None, "--cluster", "-c"),
            as_json: bool = typer.Option(False, "--json")) -> None:
    """Runs side by side: the recipe fields in which they differ, their losses, evaluation, speed,
    GPU-hours, cost and goodput."""
    from toolkit.report.compare import compare as side_by_side
    from toolkit.runs.status import queued_runs, run_status
    from toolkit.slurm.client import default_client

    if len(set(run_ids)) < 2:
        raise FtError("ft compare needs two runs or more", hint="name them: ft compare RUN RUN [RUN...] (`ft ls`)")
    store, client = _store(cluster), default_client()
    queued = queued_runs(client)  # one look at the queue for every run
    found = side_by_side([run_status(store, run_id, client, queued) for run_id in dict.fromkeys(run_ids)])
    if as_json:
        print_json(found.to_dict())
        return
    from rich.table import Table

    table = Table(title=f"{len(found.runs)} runs" + (f", differing in {', '.join(found.varied)}" if found.varied
                                                      else ", with alike recipes"), title_justify="left")
    for column in ("run", "state", *found.varied, "steps", "final loss", "best loss", "eval loss", "gates",
                   "tokens/s", "GPU-hours", "cost", "goodput"):
        table.add_column(plain(column), justify="left" if column in ("run", "state", "gates") else "right")
    for run in found.runs:
        evaluated = ", ".join(f"{split.replace('_', '-')} {loss:.4f}" for split, loss in run.eval_loss.items())
        price = _price(run.cluster)
        cost = run.gpu_hours * price if run.gpu_hours is not None and price else None
        varied = (plain(_shown(run.varied[name])) for name in found.varied)
        table.add_row(plain(run.run_id), _coloured(run.state), *varied, _shown(run.steps),
                      _shown(run.final_loss, "{:.4f}"), _shown(run.best_loss, "{:.4f}"),
                      plain(evaluated or "-"), plain(run.verdict or "-"), _shown(run.tokens_per_s, "{:,.0f}"),
                      _shown(run.gpu_hours, "{:.3f}"), _shown(cost, "${:,.2f}"), _shown(run.goodput, "{:.0%}"))
    console.print(table)


@functools.cache
def _price(cluster: str) -> float:
    """The cluster's price per GPU-hour (0 where its profile has none, or cannot be read)."""
    from toolkit.cluster.profile import ProfileError, load_profile

    try:
        return load_profile(cluster).price_per_gpu_hour or 0.0
    except ProfileError:
        return 0.0


def _shown(value, pattern: str = "{}") -> str:
    return "-" if value is None else pattern.format(value)


def report(run_id: str = typer.Argument(...), cluster: str = typer.Option(None, "--cluster", "-c"),
           output: Path = typer.Option(None, "--output", "-o",
                                       help="Where to write the page (default: in the run folder).")) -> None:
    """Write one self-contained HTML page of a run: loss and throughput, starts and faults, where the
    time went, checkpoints, data, cost. Open it in any browser; it fetches nothing."""
    from toolkit.base.shared_dirs import write_output
    from toolkit.cluster.profile import ProfileError, load_profile
    from toolkit.report.page import render
    from toolkit.runs.status import run_status
    from toolkit.slurm.client import default_client

    current = run_status(_store(cluster), run_id, default_client())
    target = output or RunLayout(current.run_dir).report
    if not target.parent.is_dir():
        raise FtError(f"{target.parent} is not a folder", hint="give --output a path in an existing folder")
    try:
        price = load_profile(current.run.cluster).price_per_gpu_hour
    except ProfileError:
        price = 0.0
    try:
        write_output(target, render(current, price))
    except OSError as exc:
        raise FtError(f"could not write {target}: {exc.strerror or exc}",
                      hint="give --output a path you can write") from exc
    console.print(f"report of run [bold]{plain(run_id)}[/]: {plain(target)}", soft_wrap=True)


def sync(run_id: str = typer.Argument(...), cluster: str = typer.Option(None, "--cluster", "-c"),
         project: str = typer.Option(None, "--project", help="W&B project (default: the recipe's, else ft)."),
         entity: str = typer.Option(None, "--entity", help="W&B entity (default: the recipe's, else yours)."),
         again: bool = typer.Option(False, "--all", help="Push the folders W&B already synced too.")) -> None:
    """Push a run's offline W&B logs to W&B from here (compute nodes often reach no internet)."""
    from toolkit.cluster.profile import ProfileError, load_profile
    from toolkit.runs import wandb_sync

    store = _store(cluster)
    record = store.load(run_id)
    run_dir = store.run_dir(run_id)
    folders = wandb_sync.offline_runs(run_dir, include_synced=again)
    if not folders:
        synced = wandb_sync.offline_runs(run_dir, include_synced=True)
        console.print(f"run {plain(run_id)}: " + (
            "every offline W&B log is synced already (--all pushes them again)" if synced
            else "no offline W&B log (it logged online, or not at all)"))
        return
    wandb_spec = RunLayout(run_dir).read_spec().recipe.tracking.wandb
    try:
        training_python = load_profile(record.cluster).python  # a prepared venv's, with wandb
    except ProfileError:
        training_python = ""
    failed = wandb_sync.sync(folders, project or wandb_spec.project or "ft", entity or wandb_spec.entity,
                             wandb_sync.client_python(training_python), run_dir)
    if failed:
        raise FtError(f"W&B did not take {len(failed)} of run {run_id}'s {len(folders)} offline logs "
                      f"({', '.join(folder.name for folder in failed)})",
                      hint="wandb's messages are above: `wandb login` (or WANDB_API_KEY), and the network to W&B")
    console.print(f"run [bold]{plain(run_id)}[/]: {len(folders)} offline W&B log{'s' * (len(folders) != 1)} pushed")


LOG_CHUNK_BYTES = 1 << 20


def read_from(path: Path, position: int) -> Iterator[tuple[int, bytes]]:
    """What a log holds past `position`, in chunks (a log of any size streams in bounded memory).
    Only a regular file is read: a FIFO or a device put in a log's place (/dev/zero) would block
    or never end."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        raise FtError(f"cannot read {path}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise FtError(f"{path} is not a regular file (a FIFO, a device or a folder): ft reads logs only from files",
                      hint="remove it; Slurm and ft write the run's logs as files")
    with os.fdopen(descriptor, "rb") as handle:
        if os.fstat(descriptor).st_size < position:  # cut short or replaced while followed: from its start
            position = 0
        handle.seek(position)
        while chunk := handle.read(LOG_CHUNK_BYTES):
            yield position, chunk
            position += len(chunk)


def logs(run_id: str = typer.Argument(None, help="The run (default: the newest one)."),
         follow: bool = typer.Option(False, "--follow", "-f"),
         node: str = typer.Option(None, "--node", help="A node's launcher log."),
         rank: int = typer.Option(None, "--rank", help="A rank's log."),
         cluster: str = typer.Option(None, "--cluster", "-c"),
         as_json: bool = typer.Option(False, "--json", help="One JSON object per chunk: path, offset, text.")) -> None:
    """Print a run's log: the job's by default, one node's or one rank's on request."""
    from toolkit.runs.status import job_of, log_path
    from toolkit.slurm.client import default_client

    store, client = _store(cluster), default_client()
    run_id = newest_run(store, run_id)
    record = store.load(run_id)
    job_id = job_of(record, client)
    path = log_path(store.run_dir(run_id), job_id, node, rank)
    position = 0
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character split across reads
    while True:
        if path.exists():
            for offset, chunk in read_from(path, position):
                position = offset + len(chunk)
                text = decoder.decode(chunk)
                if as_json:
                    print(json.dumps({"path": str(path), "offset": offset, "text": text}), flush=True)
                else:
                    typer.echo(text, nl=False)
        elif not follow:
            available = sorted(p.name for p in RunLayout(store.run_dir(run_id)).logs.glob("*"))
            job = None
            with contextlib.suppress(FtError):  # Slurm away: the missing log is said all the same
                job = client.job(job_id) if job_id else None
            raise FtError(f"no log at {path}" + ("" if job and job.finished else " yet"),
                          hint="logs there: " + (", ".join(available) or "none")
                          + ("; --node takes a node's name (node-<name>.log)" if node else ""))
        if not follow:
            if node is None and rank is None and not as_json:  # the job's log says little of training
                typer.echo(f"(training: ft logs {run_id} --rank 0; a node's launcher: --node NODE)", err=True)
            return
        job = client.job(job_id) if job_id else None
        if job and job.finished:
            follow = False  # one last read above picks up what the job wrote at the end
            continue
        time.sleep(1.0)


def cancel(run_id: str = typer.Argument(...), cluster: str = typer.Option(None, "--cluster", "-c"),
           as_json: bool = typer.Option(False, "--json")) -> None:
    """Cancel a run's job."""
    from toolkit.runs.status import job_of
    from toolkit.slurm.client import default_client

    client = default_client()
    job_id = job_of(_store(cluster).load(run_id), client)
    if not job_id:
        raise FtError(f"run {run_id} has no Slurm job", hint="a rendered script joins its run when it is submitted")
    client.cancel([job_id])
    if as_json:
        print_json({"run_id": run_id, "cancelled_job": job_id})
        return
    console.print(f"cancelled job {plain(job_id)} of run {plain(run_id)}")
