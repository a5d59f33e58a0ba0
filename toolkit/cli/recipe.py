"""`ft recipe explain` and `ft render`: what a recipe resolves to, and the script it becomes."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import typer

from toolkit.base.errors import FtError
from toolkit.cli.output import console, plain, print_json

app = typer.Typer(help="Recipes: check them and see every resolved value.", no_args_is_help=True)

RECIPE = typer.Argument(..., help="Recipe file (YAML).", exists=False)
CLUSTER = typer.Option(None, "--cluster", "-c", help="Cluster profile (default: the recipe's, else this site's).")


@app.command()
def explain(recipe: Path = RECIPE, cluster: str = CLUSTER,
            as_json: bool = typer.Option(False, "--json", help="Machine-readable output.")) -> None:
    """Show the fully resolved recipe and where each value came from."""
    from toolkit.recipe.resolve import resolve
    from toolkit.render.node_request import node_request

    resolved = resolve(recipe, cluster)
    values = resolved.values()
    derived = {f"derived.{name}": value for name, value in resolved.derived.model_dump(mode="json").items()}
    node = node_request(resolved)
    derived |= {"derived.node_cpus": "whole node" if node.exclusive else node.cpus,
                "derived.node_memory_mb": "whole node" if node.exclusive else node.memory_mb}
    memory = None
    if resolved.memory:
        plan, budget = resolved.memory
        memory = {"per_rank_bytes": dict(plan.parts()), "total_bytes": plan.total, "rank_memory_bytes": budget}
    if as_json:
        print_json({"values": values | derived, "sources": resolved.sources, "warnings": list(node.warnings),
                    "memory_plan": memory})
        return
    from rich.table import Table

    table = Table(title=f"{plain(recipe)} on {plain(resolved.profile.name)}", title_justify="left")
    for column in ("field", "value", "from"):
        table.add_column(column)
    for dotted, value in values.items():
        origin = resolved.sources.get(dotted, "")
        style = "" if origin == "recipe" else "dim"
        table.add_row(plain(dotted), plain(value), plain(origin), style=style)
    for dotted, value in derived.items():
        table.add_row(plain(dotted), plain(value), "computed", style="cyan")
    console.print(table)
    if resolved.memory:
        print_memory_plan(*resolved.memory)
    for warning in node.warnings:
        console.print(f"[yellow]warning:[/] {plain(warning)}")


def print_memory_plan(plan, budget: int) -> None:
    from rich.table import Table

    from toolkit.recipe.memory_plan import gib

    table = Table(title="memory plan of one rank", title_justify="left")
    table.add_column("part")
    table.add_column("estimate", justify="right")
    for name, value in plan.parts():
        table.add_row(name, gib(value))
    table.add_row("total", gib(plan.total), style="bold")
    table.add_row("a rank has", gib(budget), style="green" if plan.total <= budget else "red")
    console.print(table)


def local_slurm_version(profile_name: str) -> tuple[int, int, int] | None:
    """This machine's Slurm version when rendering for this site's own cluster; None otherwise."""
    from toolkit.cluster.profile import default_profile_name
    from toolkit.slurm.client import CliSlurmClient
    from toolkit.slurm.commands import SlurmCommandError, SlurmUnavailable

    if profile_name != default_profile_name():
        return None
    try:
        return CliSlurmClient(timeout=5).version()
    except (SlurmUnavailable, SlurmCommandError, ValueError):  # no Slurm here, or no version it says: render for none
        return None


def render_command(
    recipe: Path = RECIPE,
    cluster: str = CLUSTER,
    output: Path = typer.Option(None, "--output", "-o", help="Write the script here (default: stdout)."),
    run_id: str = typer.Option(None, "--run-id", help="Run id (default: the recipe's name)."),
    preflight: bool = typer.Option(False, "--preflight", help="Render a job that only checks the allocation."),
) -> None:
    """Render the standalone sbatch script of a recipe."""
    from toolkit.base.shared_dirs import private_dir, write_output
    from toolkit.recipe.resolve import resolve
    from toolkit.render.sbatch import RunPlacement, render
    from toolkit.runs.store import RunRecord, RunStore

    resolved = resolve(recipe, cluster)
    run_id = run_id or resolved.recipe.name
    store = RunStore.for_shared_root(resolved.profile.shared_root)
    run_dir = store.run_dir(run_id)
    script = render(resolved, RunPlacement(run_id, str(run_dir)), mode="preflight" if preflight else "train",
                    slurm_version=local_slurm_version(resolved.profile.name))
    if output is None:
        if run_dir.exists():
            private_dir(run_dir)  # another user's folder there: say so now, not when the job starts
        typer.echo(script, nl=False)
        return
    existed = run_dir.exists()
    store.create_run_dir(run_id, exist_ok=True)  # the script's log folder must exist at sbatch time
    try:
        write_output(output, script, mode=0o700)
    except FtError:
        if not existed:  # nothing half-done: no run folder for a script that was never written
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    # `ft ls` shows the run now; its job adds itself as it starts.
    store.placeholder(RunRecord(run_id, resolved.recipe.name, str(recipe.resolve()), resolved.profile.name,
                                "preflight" if preflight else "train", time.time()))
    console.print(f"wrote {plain(output)}: sbatch it as is, or edit it first (its logs go to {plain(run_dir)}/logs)")
