"""A command run in a real terminal (tmux, on a private server of the test's own), its screen
captured as a person would see it while it runs."""

from __future__ import annotations

import os
import shlex
import subprocess
import threading
import time
import uuid
from pathlib import Path


class Terminal:
    """`tmux -L <own socket> new-session -d -x COLUMNS -y LINES COMMAND`; frames are captured every
    `every` seconds in a thread until the command ends or `close()`."""

    def __init__(self, argv: list[str], folder: Path, env: dict[str, str] | None = None,
                 columns: int = 110, lines: int = 40, every: float = 1.0):
        self.socket = f"ft-test-{uuid.uuid4().hex[:8]}"
        self.exit_file = folder / f"{self.socket}.exit"
        self.env = dict(os.environ, **(env or {}))
        command = f"{shlex.join(argv)}; echo $? > {shlex.quote(str(self.exit_file))}; sleep 600"
        self.tmux(["new-session", "-d", "-s", "view", "-x", str(columns), "-y", str(lines), command])
        self.frames: list[str] = []
        self.stopped = threading.Event()
        self.every = every
        self.thread = threading.Thread(target=self._capture, daemon=True)
        self.thread.start()

    def tmux(self, args: list[str]) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, env=self.env,
                              timeout=30, check=True).stdout

    def screen(self) -> str:
        return self.tmux(["capture-pane", "-p", "-t", "view"])

    def history(self) -> str:
        """Everything the pane has shown that scrolled off, and the screen."""
        return self.tmux(["capture-pane", "-p", "-S", "-", "-t", "view"])

    def _capture(self) -> None:
        while not self.stopped.wait(self.every):
            try:
                self.frames.append(self.screen())
            except subprocess.SubprocessError:
                return
            if self.exit_file.exists():
                return

    def exit_code(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while not self.exit_file.exists():
            if time.monotonic() > deadline:
                raise AssertionError(f"the command in the terminal did not end within {timeout:.0f} s:\n"
                                     + self.screen())
            time.sleep(0.5)
        return int(self.exit_file.read_text().strip() or -1)

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=10)
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, env=self.env, timeout=30)
