"""Errors that ft reports to users: each says what is wrong, where, and how to fix it."""

from __future__ import annotations


class FtError(Exception):
    """A user-facing error. The CLI prints `message` (and `hint`) and exits with `exit_code`."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class UsageError(FtError):
    """Bad input on the command line (a flag, an argument)."""

    exit_code = 2
