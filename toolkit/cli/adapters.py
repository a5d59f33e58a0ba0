"""`ft adapters …`: the adapter registry (toolkit/registry/): its versions, their states, and the
handoff a LoRA serving fleet loads."""

from __future__ import annotations

from datetime import datetime

import typer

from toolkit.cli.output import console, err_console, plain, print_json
from toolkit.registry.states import State

app = typer.Typer(help="LoRA adapters in the cluster's registry: versions, their states (draft, promoted, "
                       "deprecated), the handoff a serving fleet loads.", no_args_is_help=True)

COLOURS = {State.draft: "yellow", State.promoted: "green", State.deprecated: "dim"}
CLUSTER = typer.Option(None, "--cluster", "-c", help="Cluster profile (default: this site's).")
JSON = typer.Option(False, "--json", help="Machine-readable output.")
REASON = typer.Option("", "--reason", "-m", help="Why: kept in the name's log.")


def _registry(cluster: str | None):
    """The profile's registry, mirrored under its s3_prefix; what misses the mirror is said on stderr."""
    from toolkit.cluster.profile import load_profile
    from toolkit.registry.mirror import RegistryMirror
    from toolkit.registry.store import Registry

    profile = load_profile(cluster)
    return Registry.for_shared_root(profile.shared_root, RegistryMirror.for_prefix(profile.s3_prefix,
                                                                                   profile.s3_endpoint),
                                    lambda message: err_console.print(f"[yellow]warning:[/] {plain(message)}",
                                                                      soft_wrap=True))


def _state(state: State) -> str:
    return f"[{COLOURS[state]}]{state}[/]"


def _when(seconds: float) -> str:
    try:
        return datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M")
    except (OverflowError, OSError, ValueError):  # a time no clock shows: listed all the same
        return "?"


def _evaluation(record) -> str:
    from toolkit.registry.records import promotion_problem

    if "passed" not in record.eval:
        return "-"
    return "[green]passed[/]" if promotion_problem(record) is None else "[red]failed[/]"


def _base(record) -> str:
    return record.base_model + (f"@{record.base_revision}" if record.base_revision else "")


@app.command()
def ls(name: str = typer.Option(None, "--name", help="Only this adapter name's versions."),
       state: State = typer.Option(None, "--state", help="Only versions in this state."),
       cluster: str = CLUSTER, as_json: bool = JSON) -> None:
    """List the registry's versions, newest first."""
    registry = _registry(cluster)
    versions = registry.versions(name, state)
    if as_json:
        print_json([version.to_dict() for version in versions])
        return
    from rich.table import Table

    table = Table(title=f"adapters in {plain(registry)}", title_justify="left")
    for column in ("version", "name", "state", "base model", "run", "eval", "creator", "registered"):
        table.add_column(column, overflow="fold", no_wrap=column in ("version", "state"))  # an id to copy whole
    for version in versions:
        record = version.record
        table.add_row(version.short_id, plain(record.name), _state(version.state), plain(_base(record)),
                      plain(record.run_id or "-"), _evaluation(record), plain(record.creator), _when(record.created))
    console.print(table)


@app.command()
def show(version: str = typer.Argument(..., help="A version id, or a unique prefix of it."),
         cluster: str = CLUSTER, as_json: bool = JSON) -> None:
    """One version: its record, evaluation, files, handoff and history."""
    registry = _registry(cluster)
    found = registry.version(version)
    log = registry.history(found.name)
    for skipped in log.skipped:  # damage the log's owner should know of
        err_console.print(f"[yellow]warning:[/] the log of {plain(found.name)} has a line left out: {plain(skipped)}")
    history = [move for move in log.transitions if move.version == found.id]
    changed = registry.files_changed(found)
    if as_json:
        print_json({**found.to_dict(), "files_as_registered": not changed,
                    "history": [move.to_dict() for move in history]})
        return
    if changed:
        err_console.print(f"[bold red]its files are not those registered[/]: a serving fleet must refuse them "
                          f"(their sha256 are in {plain(found.to_dict()['serving'])})")
    record = found.record
    modules = record.lora.target_modules  # a list, or peft's regular expression
    modules = ", ".join(modules) if isinstance(modules, list) else modules
    console.print(f"version [bold]{found.id}[/] of [bold]{plain(record.name)}[/]: {_state(found.state)}")
    for label, value in (("base model", _base(record)), ("run", record.run_id or "-"),
                         ("account", record.account or "-"), ("creator", record.creator),
                         ("registered", _when(record.created)), ("ft", record.ft_version),
                         ("lora", f"rank {record.lora.rank}, alpha {record.lora.alpha:g}, modules {modules}"),
                         ("adapter", found.adapter), ("handoff", found.to_dict()["serving"])):
        console.print(f"  {label}: {plain(value)}", soft_wrap=True)
    for file, digest in sorted(record.data_digests.items()):
        console.print(f"  data {plain(file)}: sha256 {digest}", soft_wrap=True)
    console.print(f"  evaluation: {_evaluation(record)}")
    for gate in record.eval.get("gates", []) if isinstance(record.eval.get("gates"), list) else []:
        if isinstance(gate, dict):
            mark = "[green]passed[/]" if gate.get("passed") is True else "[red]failed[/]"
            console.print(f"    {plain(gate.get('name', '?'))}: {mark} {plain(gate.get('detail', ''))}", soft_wrap=True)
    for file, digest in sorted(record.files.items()):
        console.print(f"  file {plain(file)}: {digest.bytes} bytes, sha256 {digest.sha256}", soft_wrap=True)
    for move in history:
        console.print(f"  {_when(move.time)} {move.from_state} -> {_state(move.to_state)} by {plain(move.user)}"
                      + (f": {plain(move.reason)}" if move.reason else ""), soft_wrap=True)


def _moved(change, verb: str, as_json: bool) -> None:
    if as_json:
        print_json({**change.version.to_dict(), "transitions": [move.to_dict() for move in change.transitions]})
        return
    if not change.transitions:
        console.print(f"version {change.version.short_id} of {plain(change.version.name)} was {verb} already")
        return
    for move in change.transitions:
        console.print(f"version {move.version[:12]} of {plain(change.version.name)}: {move.from_state} -> "
                      f"{_state(move.to_state)}" + (f" ({plain(move.reason)})" if move.reason else ""))


@app.command()
def promote(version: str = typer.Argument(..., help="A version id, or a unique prefix of it."),
            reason: str = REASON, cluster: str = CLUSTER, as_json: bool = JSON) -> None:
    """Serve this version under its name: the one promoted before is deprecated. Refused (exit 2) for a
    version whose evaluation failed, that was deprecated, or whose name is another user's."""
    _moved(_registry(cluster).promote(version, reason), "promoted", as_json)


@app.command()
def deprecate(version: str = typer.Argument(..., help="A version id, or a unique prefix of it."),
              reason: str = REASON, cluster: str = CLUSTER, as_json: bool = JSON) -> None:
    """Retire this version for good (a promoted one leaves its name serving none)."""
    _moved(_registry(cluster).deprecate(version, reason), "deprecated", as_json)


@app.command()
def sync(cluster: str = CLUSTER, as_json: bool = JSON) -> None:
    """Upload to the object store what the registry's mirror lacks (after a failed upload)."""
    report = _registry(cluster).sync()
    if as_json:
        print_json({"versions": report.versions, "names": report.names, "problems": report.problems})
    else:
        console.print(f"mirrored {len(report.versions)} version(s) and the states of {len(report.names)} name(s)")
        for problem in report.problems:
            err_console.print(f"[red]not mirrored:[/] {plain(problem)}", soft_wrap=True)
    if report.problems:
        raise typer.Exit(1)
