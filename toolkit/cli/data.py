"""`ft validate` and `ft data check`: the data is checked on the login node, before queueing."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import typer

from toolkit.cli.output import console, err_console, plain, print_json

app = typer.Typer(help="Data files: check one on its own.", no_args_is_help=True)


@contextmanager
def byte_progress(label: str):
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=err_console.get(), transient=True) as progress:
        tasks: dict[str, int] = {}

        def update(name: str, done: int, total: int | None) -> None:
            if name not in tasks:
                tasks[name] = progress.add_task(f"{label} {name}", total=total)
            progress.update(tasks[name], completed=done, total=total)

        yield update


def show(reports, as_json: bool) -> None:
    from rich.table import Table

    if as_json:
        print_json([report.to_dict() for report in reports])
        return
    for report in reports:
        stats = report.tokens
        console.print(f"[bold]{plain(report.path)}[/]: {report.rows} rows, format {plain(report.format or '?')}, "
                      f"{report.duplicates} exact duplicates"
                      + (f", tokens total {stats['total']} mean {stats['mean']} p50 {stats['p50']:.0f} "
                         f"p95 {stats['p95']:.0f} max {stats['max']}" if stats else ""))
        for severity, kinds, colour in (("error", report.errors, "red"), ("warning", report.warnings, "yellow")):
            if not kinds:
                continue
            table = Table(title=f"{severity}s", title_justify="left", title_style=colour)
            for column in ("kind", "count", "first locations"):
                table.add_column(column)
            for kind, summary in sorted(kinds.items()):
                where = "\n".join(plain(finding) for finding in summary.examples)
                table.add_row(kind, str(summary.count), where)
            console.print(table)
        console.print("[green]ok[/]" if report.ok else f"[red]{sum(s.count for s in report.errors.values())} "
                                                      f"errors[/]")


def validate(recipe: Path = typer.Argument(..., help="Recipe file (YAML)."),
             cluster: str = typer.Option(None, "--cluster", "-c"),
             tokenizer: str = typer.Option(None, "--tokenizer", help="Tokenizer to count with (default: the model's)."),
             as_json: bool = typer.Option(False, "--json")) -> None:
    """Check a recipe's data: format, fields, lengths in tokens, duplicates, personal data."""
    from toolkit.data.recipe_data import validate_recipe_data
    from toolkit.recipe.resolve import resolve

    resolved = resolve(recipe, cluster)
    with byte_progress("validating") as progress:
        reports = validate_recipe_data(resolved, tokenizer, progress)
    show(reports, as_json)
    if not all(report.ok for report in reports):
        raise typer.Exit(1)


@app.command()
def check(file: str = typer.Argument(..., help="Data file: .jsonl, .csv or .parquet, maybe .gz/.zst; local or s3://."),
          data_format: str = typer.Option("auto", "--format", help="auto, prompt_completion, chat or preference."),
          tokenizer: str = typer.Option(None, "--tokenizer", help="tokenizer.json, a model folder, or tiny-llama."),
          max_seq_len: int = typer.Option(None, "--max-seq-len", help="Longest example allowed, in tokens."),
          min_rows: int = typer.Option(100, "--min-rows"),
          as_json: bool = typer.Option(False, "--json")) -> None:
    """Check one data file."""
    from toolkit.data.tokenizer import load_length_counter
    from toolkit.data.validate import Limits, validate_file

    counter = load_length_counter(tokenizer) if tokenizer else None
    with byte_progress("checking") as progress:
        report = validate_file(file, data_format, counter, Limits(max_seq_len=max_seq_len, min_rows=min_rows),
                               progress=lambda done, total: progress(Path(file).name, done, total))
    show([report], as_json)
    if not report.ok:
        raise typer.Exit(1)
