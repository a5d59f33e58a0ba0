"""The `ft` command. Each sub-command group lives in its own module."""

from __future__ import annotations

import os
import sys

# ft uses no pydantic plugins; without this, pydantic scans every installed package's entry points.
os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")

import typer

from toolkit.base.build import VERSION
from toolkit.base.errors import FtError
from toolkit.cli import (
    adapters,
    chaos,
    cluster,
    data,
    doctor,
    lab,
    model,
    plan,
    receipt,
    recipe,
    runs,
    usage,
)
from toolkit.cli.output import print_error

app = typer.Typer(
    name="ft",
    help="Slurm-native fine-tuning of LLMs: validate, render, submit, watch.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(lab.app, name="lab")
app.add_typer(recipe.app, name="recipe")
app.add_typer(data.app, name="data")
app.add_typer(chaos.app, name="chaos")
app.add_typer(model.app, name="model")
app.add_typer(cluster.app, name="cluster")
app.add_typer(adapters.app, name="adapters")
app.add_typer(receipt.app, name="receipt")
app.command()(data.validate)
app.command("render")(recipe.render_command)
app.command()(runs.submit)
app.command()(runs.ls)
app.command()(runs.status)
app.command()(runs.report)
app.command()(runs.compare)
app.command()(runs.sync)
app.command()(runs.logs)
app.command()(runs.cancel)
app.command()(usage.usage)
app.command()(plan.plan)
app.command()(doctor.doctor)


def show_version(value: bool) -> None:
    if value:
        print(f"ft {VERSION}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(False, "--version", callback=show_version, is_eager=True,
                                 help="Print ft's version and exit."),
) -> None:
    """ft: fine-tuning on Slurm clusters."""


def main() -> None:
    try:
        app()
    except FtError as exc:
        print_error(exc.message, exc.hint)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print_error("interrupted")
        sys.exit(130)
