"""`ft lab …`: the local multi-node Slurm lab."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import typer

from toolkit.base.errors import FtError
from toolkit.cli.output import console, plain, print_json, task_spinner

if TYPE_CHECKING:
    from rich.table import Table

    from toolkit.lab.status import LabStatus

app = typer.Typer(help="The local lab: a real multi-node Slurm cluster on this machine.", no_args_is_help=True)


def status_tables(status: LabStatus) -> list[Table]:
    from rich.table import Table

    daemons = Table(title=f"the lab, cluster [bold]{status.cluster}[/]: daemons", title_justify="left")
    daemons.add_column("daemon")
    daemons.add_column("pid", justify="right")
    daemons.add_column("state")
    for daemon in status.daemons:
        state = "[green]running[/]" if daemon.running else "[red]stopped[/]"
        daemons.add_row(daemon.name, str(daemon.pid or "-"), state)
    nodes = Table(title="nodes", title_justify="left")
    for column in ("node", "address", "state", "gpus used", "reason"):
        nodes.add_column(column)
    for node in status.nodes:
        colour = "green" if node.serving else "red"
        state = node.state + ("+" + "+".join(f.lower() for f in node.flags) if node.flags else "")
        nodes.add_row(plain(node.name), plain(node.address), f"[{colour}]{plain(state)}[/]", plain(node.gpus),
                      plain(node.reason))
    return [daemons, nodes]


def print_status(status: LabStatus) -> None:
    for table in status_tables(status):
        console.print(table)
    if status.object_store:
        store = status.object_store
        state = "[green]answering[/]" if store.answering else "[red]not answering[/]"
        buckets = ", ".join(f"s3://{plain(name)}" for name in store.buckets.values())
        console.print(f"object store {plain(store.url)}: {state}; buckets {buckets} "
                      "([dim]credentials: eval \"$(ft lab env)\"[/])", soft_wrap=True)
    if status.prometheus:
        state = "[green]answering[/]" if status.prometheus["answering"] else "[red]not answering[/]"
        console.print(f"Prometheus {plain(status.prometheus['url'])}: {state} (every run's metrics)")
    if status.problems:
        console.print("[red]problems:[/]")
        for problem in status.problems:
            console.print(f"  - {plain(problem)}")
        console.print("`ft lab up` starts what is down and brings crashed nodes back (a drained node's reason: "
                      "`sinfo -R`)")
    else:
        console.print(f"[green]lab is up[/]: {len(status.nodes)} nodes serving jobs, Slurm {plain(status.slurm)}")


@app.command()
def up(
    nodes: int = typer.Option(None, "--nodes", "-n", help="Compute nodes (default: the current lab's, else 4)."),
    slices: int = typer.Option(None, "--slices",
                               help="Split the nodes into this many slices, each with its own partitions and "
                                    "ft profile (default: the current lab's, else 1; the test suite uses 2)."),
    reprovision: bool = typer.Option(False, "--reprovision",
                                     help="Run the playbook even when the lab is already up as configured."),
    slurm: str = typer.Option(None, "--slurm",
                              help="Slurm release: 22.05 (Debian's package), 24.11 or 26.05 (built once from "
                                   "Debian's source package, about 5 minutes); default: the current lab's, "
                                   "else 22.05."),
) -> None:
    """Provision and start the lab through ft's Ansible roles. Safe to repeat."""
    from toolkit.lab import lifecycle

    with task_spinner("lab up") as on_task:
        outcome = lifecycle.up(nodes=nodes, slices=slices, reprovision=reprovision, on_task=on_task, slurm=slurm)
    if outcome.playbook is None:
        console.print("lab is already up as configured: nothing changed "
                      "([dim]--reprovision runs the playbook anyway[/])")
    elif outcome.changed == 0:
        console.print(f"lab playbook ran in {outcome.playbook.seconds:.1f} s: nothing changed")
    else:
        console.print(f"lab playbook ran in {outcome.playbook.seconds:.1f} s: {outcome.changed} changes "
                      f"([dim]{', '.join(outcome.playbook.changed_tasks[:6])}"
                      f"{'…' if len(outcome.playbook.changed_tasks) > 6 else ''}[/])")
    print_status(outcome.status)
    if not outcome.status.healthy:
        raise typer.Exit(1)


@app.command()
def status(as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Show the lab's daemons and nodes. Exit status 0 when every node serves jobs, 1 otherwise."""
    from toolkit.lab.manifest import LabManifest
    from toolkit.lab.status import collect

    manifest = LabManifest.load()
    if manifest is not None and os.geteuid() != 0:
        # The daemons' pid files and the namespaces are root's to see: as another user every daemon
        # would look stopped. Slurm itself answers anyone.
        raise FtError("ft lab status needs root (the lab's daemons are root's to see)",
                      hint="as a user of the lab: `sinfo` shows its nodes, `ft doctor --cluster NAME` your setup")
    if manifest is None:
        if as_json:
            print_json({"up": False, "healthy": False, "problems": ["no lab on this machine"]})
            raise typer.Exit(1)
        raise FtError("there is no lab on this machine", hint="run `ft lab up`")
    current = collect(manifest)
    if as_json:
        print_json(current.to_dict())
    else:
        print_status(current)
    if not current.healthy:
        raise typer.Exit(1)


@app.command()
def env() -> None:
    """Print the exports that let this shell (and the jobs it submits) use the lab's object store:
    eval "$(ft lab env)". The credentials are the calling account's own lab identity (root's: the
    admin), never a cloud's. W&B is offline: the lab's nodes reach nothing off this machine."""
    import shlex

    from toolkit.lab.manifest import LabManifest

    manifest = LabManifest.load()
    if manifest is None or manifest.object_store is None:
        raise FtError("this lab has no object store", hint="run `ft lab up`")
    for name, value in {**manifest.object_store.env, "WANDB_MODE": "offline"}.items():
        print(f"export {name}={shlex.quote(value)}")


@app.command()
def down(purge: bool = typer.Option(False, "--purge",
                                    help="Also delete jobs, accounting, logs and the lab's shared directory.")) -> None:
    """Stop the lab's daemons and remove its namespaces. The guard route stays."""
    from toolkit.lab import lifecycle

    with task_spinner("lab down") as on_task:
        result = lifecycle.down(purge=purge, on_task=on_task)
    console.print(f"lab is down{' and purged' if purge else ''} ({result.seconds:.1f} s)")


@app.command()
def crash(node: str = typer.Argument(..., help="Lab node to crash, e.g. node2.")) -> None:
    """Crash one node as a power loss would: its link cut, every process killed. `ft lab up` brings it back."""
    from toolkit.lab import lifecycle

    killed = lifecycle.crash(node)
    console.print(f"{node}: killed {len(killed)} processes; Slurm marks it DOWN after ~3x SlurmdTimeout")


@app.command()
def smoke(
    nodes: int = typer.Option(2, "--nodes", "-n", help="Nodes for the job."),
    gpus_per_node: int = typer.Option(2, "--gpus-per-node", help="GPUs (GRES) per node."),
    as_json: bool = typer.Option(False, "--json", help="Machine-readable output."),
) -> None:
    """Submit a multi-node GPU job through submitit and show where each task ran."""
    from toolkit.lab.smoke import run_smoke

    with task_spinner("smoke job") as on_step:
        on_step(f"{nodes} nodes x {gpus_per_node} GPUs")
        result = run_smoke(nodes=nodes, gpus_per_node=gpus_per_node)
    if as_json:
        print_json({"job_id": result.job_id, "state": result.state, "tasks": result.tasks,
                    "seconds": result.seconds})
    else:
        from rich.table import Table

        table = Table(title=f"smoke job {result.job_id}: {result.state} in {result.seconds:.1f} s",
                      title_justify="left")
        for column in ("rank", "node", "hostname", "address", "CUDA_VISIBLE_DEVICES"):
            table.add_column(column)
        for task in result.tasks:
            table.add_row(str(task["rank"]), task["node"], task["hostname"], task["address"],
                          task["cuda_visible_devices"])
        console.print(table)
    if result.distinct_hosts != nodes:
        raise FtError(f"the job's {nodes} tasks ran on {result.distinct_hosts} distinct hosts")
