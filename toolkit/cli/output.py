"""How the CLI prints: rich for people, JSON for scripts, and errors in one format."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

from rich.console import Console

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


def print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def print_error(message: str, hint: str | None = None) -> None:
    err_console.print(f"[bold red]error:[/] {message}", markup=True, soft_wrap=True)
    if hint:
        err_console.print(f"[yellow]hint:[/] {hint}", soft_wrap=True)


@contextmanager
def task_spinner(title: str):
    """A spinner naming the running step; yields a callback that updates it."""
    with err_console.status(f"{title}…") as status:
        yield lambda step: status.update(f"{title}: [dim]{step}[/]")
