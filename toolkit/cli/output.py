"""How the CLI prints: rich for people, JSON for scripts, and errors in one format. rich is imported
on first use: a command that prints JSON or a script imports none of it (the login side starts fast)."""

from __future__ import annotations

import json
import os
import re
import sys
from contextlib import contextmanager


class LazyConsole:
    """rich's Console, made on first use."""

    def __init__(self, **options) -> None:
        self._options = options
        self._console = None

    def get(self):
        if self._console is None:
            from rich.console import Console

            options = dict(self._options)
            stream = sys.stderr if options.get("stderr") else sys.stdout
            if not stream.isatty() and "COLUMNS" not in os.environ:
                options.setdefault("width", 160)  # piped or logged: tables whole, not folded at 80
            self._console = Console(highlight=False, **options)
        return self._console

    def __getattr__(self, name: str):
        return getattr(self.get(), name)


console = LazyConsole()
err_console = LazyConsole(stderr=True)

# C0 and C1 control characters but newline and tab: an escape sequence in a recipe value, a path
# or a Slurm reason must not reach the terminal.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def plain(value: object) -> str:
    """Text from users, files or Slurm, safe to put in rich output: shown as written, never read as
    markup ([red], [/]), control characters made visible."""
    from rich.markup import escape

    text = _CONTROL.sub(lambda match: repr(match.group())[1:-1], str(value))
    return escape(text)


def print_json(data) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def print_error(message: str, hint: str | None = None) -> None:
    err_console.print(f"[bold red]error:[/] {plain(message)}", soft_wrap=True)
    if hint:
        err_console.print(f"[yellow]hint:[/] {plain(hint)}", soft_wrap=True)


@contextmanager
def task_spinner(title: str):
    """A spinner naming the running step, on a terminal; yields a callback that updates it."""
    if not sys.stderr.isatty():  # a script or a log: nothing to animate
        yield lambda step: None
        return
    with err_console.status(f"{title}…") as status:
        yield lambda step: status.update(f"{title}: [dim]{step}[/]")
