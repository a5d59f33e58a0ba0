"""Run ft's Ansible playbooks, streaming progress and keeping the full log."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from toolkit.base.errors import FtError
from toolkit.base.paths import resource_dir, state_home

_TASK = re.compile(r"^TASK \[(?P<name>.+?)\] \*+$")
_RECAP = re.compile(r"^(?P<host>\S+)\s+:\s+ok=(?P<ok>\d+)\s+changed=(?P<changed>\d+)\s+"
                    r"unreachable=(?P<unreachable>\d+)\s+failed=(?P<failed>\d+)")
_CHANGED_ITEM = re.compile(r"^changed: \[[^\]]+\]")


class PlaybookFailed(FtError):
    pass


@dataclass
class PlaybookResult:
    playbook: str
    ok: bool
    changed: int
    failed: int
    seconds: float
    log_path: Path
    changed_tasks: list[str] = field(default_factory=list)
    error: str = ""


def ansible_dir() -> Path:
    return resource_dir("ansible")


def ansible_playbook_command() -> str:
    """ansible-playbook from ft's own environment (ansible-core is one of ft's dependencies)."""
    beside = Path(sys.executable).with_name("ansible-playbook")
    return str(beside) if beside.exists() else "ansible-playbook"


def new_log_path(playbook: str) -> Path:
    logs = state_home() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    return logs / f"{Path(playbook).stem}-{stamp}.log"


def run_playbook(
    playbook: str,
    extra_vars: dict | None = None,
    *,
    inventory: str | None = None,
    check: bool = False,
    diff: bool = False,
    skip_tags: tuple[str, ...] = (),
    tags: tuple[str, ...] = (),
    on_task: Callable[[str], None] | None = None,
) -> PlaybookResult:
    """Run a playbook of ft's ansible/ folder; `on_task` hears each task name as it starts."""
    directory = ansible_dir()
    argv = [ansible_playbook_command(), playbook]
    if inventory:
        argv += ["--inventory", inventory]
    if extra_vars:
        argv += ["--extra-vars", json.dumps(extra_vars)]
    if check:
        argv.append("--check")
    if diff:
        argv.append("--diff")
    if skip_tags:
        argv += ["--skip-tags", ",".join(skip_tags)]
    if tags:
        argv += ["--tags", ",".join(tags)]
    env = dict(os.environ, ANSIBLE_CONFIG=str(directory / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
               ANSIBLE_FORCE_COLOR="0", PYTHONUNBUFFERED="1")
    log_path = new_log_path(playbook)
    started = time.monotonic()
    changed_tasks: list[str] = []
    recap: dict[str, int] = {}
    task = ""
    error_lines: list[str] = []
    with open(log_path, "w") as log, subprocess.Popen(
        argv, cwd=directory, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, text=True,
    ) as process:
        log.write(f"$ {' '.join(argv)}\n")
        assert process.stdout is not None
        for line in process.stdout:
            log.write(line)
            line = line.rstrip("\n")
            if match := _TASK.match(line):
                task = match["name"]
                if on_task:
                    on_task(task)
            elif _CHANGED_ITEM.match(line) and (not changed_tasks or changed_tasks[-1] != task):
                changed_tasks.append(task)
            elif match := _RECAP.match(line):
                for key in ("ok", "changed", "unreachable", "failed"):
                    recap[key] = recap.get(key, 0) + int(match[key])
            if line.startswith(("fatal:", "[ERROR]", "ERROR!")) or (error_lines and line.startswith("    ")):
                error_lines.append(line)
    ok = process.returncode == 0
    return PlaybookResult(
        playbook=playbook,
        ok=ok,
        changed=recap.get("changed", 0),
        failed=recap.get("failed", 0) + recap.get("unreachable", 0),
        seconds=time.monotonic() - started,
        log_path=log_path,
        changed_tasks=changed_tasks,
        error="" if ok else "\n".join(error_lines[-30:]) or f"ansible-playbook exited {process.returncode}",
    )
