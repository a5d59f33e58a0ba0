"""`ft plan RECIPE`: every cluster profile and tier that fits the recipe, its expected start, price,
cost and finish, and the one `ft submit --cluster auto` would take (toolkit/cluster/broker.py)."""

from __future__ import annotations

from pathlib import Path

import typer

from toolkit.cli.output import console, plain, print_json
from toolkit.cluster.broker import Preference


def plan(recipe: Path = typer.Argument(..., help="Recipe file (YAML)."),
         prefer: Preference = typer.Option(Preference.cheapest, "--prefer",
                                           help="cheapest (starting within --max-wait) or soonest"),
         max_wait: float = typer.Option(30.0, "--max-wait", min=0, help="minutes the cheapest may wait to start"),
         as_json: bool = typer.Option(False, "--json")) -> None:
    """Where a run would start soonest or cost least, on every configured cluster and tier."""
    from toolkit.base.errors import FtError
    from toolkit.cli.output import task_spinner
    from toolkit.cluster import broker
    from toolkit.cluster.profile import available_profiles

    with task_spinner("plan") as step:
        step("asking Slurm for each cluster and tier")
        found = broker.options(recipe, available_profiles())
    try:
        best, why = broker.choose(found, prefer, max_wait * 60)
    except FtError as error:
        best, why = None, error.message
    if as_json:
        print_json({"prefer": prefer.value, "max_wait_minutes": max_wait, "options": [o.to_dict() for o in found],
                    "chosen": best.to_dict() if best else None, "why": why})
        return
    from rich.table import Table

    table = Table(title=f"where {plain(recipe)} could run", title_justify="left")
    for column in ("cluster", "tier", "partition", "GPUs", "start", "$/GPU-h", "cost, at most", "finish", "note"):
        table.add_column(column, overflow="fold")
    for option in sorted(found, key=lambda o: (not o.fits, o.start is None, o.start or 0, o.cost)):
        mark = "[bold green]> [/]" if option is best else ""
        table.add_row(mark + plain(option.cluster), plain(option.tier), plain(option.partition), str(option.gpus),
                      broker.stamp(option.start) if option.fits else "-", f"{option.price:g}",
                      f"${option.cost:,.2f}" if option.fits else "-",
                      broker.stamp(option.finish) if option.fits else "-",
                      plain(option.why) if not option.fits or option.start is None else "")
    console.print(table)
    if best:
        console.print(f"ft submit --cluster auto would take [bold]{plain(best.cluster)}[/] ({plain(best.tier)}): "
                      f"{plain(why)}")
    else:
        console.print(f"no automatic choice: {plain(why)}")
