"""Run Slurm's command-line tools with a time limit and clear errors.

Every call has a timeout: a controller that does not answer must never leave ft waiting forever.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from toolkit.base.errors import FtError

DEFAULT_TIMEOUT_S = 20.0


def slurm_time(text: str) -> float | None:
    """A time as Slurm's tools print it (ISO, local), as a Unix time; None for N/A, Unknown, None."""
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def parse_config(text: str) -> dict[str, str]:
    """`scontrol show config`'s `Name = value` lines, by name ("(null)" where unset)."""
    config = {}
    for line in text.splitlines():
        name, equals, value = line.partition("=")
        if equals and name.strip() and " " not in name.strip():
            config.setdefault(name.strip(), value.strip())
    return config


def expand_hostlist(text: str) -> list[str]:
    """Slurm's host list as names: node[1-3,07],gpu-a -> node1 node2 node3 node07 gpu-a (several
    bracketed ranges in one name too: rack[1-2]-n[1-2]). What scontrol show hostnames does, without
    a call per list."""
    names, depth, start = [], 0, 0
    for index, char in enumerate(text + ","):
        depth += (char == "[") - (char == "]")
        if char == "," and depth == 0:
            names += _expand_one(text[start:index].strip())
            start = index + 1
    return [name for name in names if name]


def _expand_one(name: str) -> list[str]:
    head, bracket, rest = name.partition("[")
    if not bracket or "]" not in rest:
        return [name]
    ranges, _, tail = rest.partition("]")
    found = []
    for part in ranges.split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()) or (high and int(high) - int(low) > 100_000):
            return [name]  # not a range Slurm writes: the name as it is
        for number in range(int(low), int(high or low) + 1):
            found += [f"{head}{number:0{len(low)}d}{more}" for more in _expand_one(tail)]
    return found


class SlurmUnavailable(FtError):
    """The Slurm tools are missing or the controller does not answer."""


class SlurmCommandError(FtError):
    """A Slurm command ran and failed."""


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str


def slurm_env() -> dict[str, str]:
    """The environment for Slurm tools. Without a config file, sbatch looks the controller up in
    DNS, so ft refuses to run them unless SLURM_CONF or /etc/slurm/slurm.conf exists."""
    env = dict(os.environ)
    conf = env.get("SLURM_CONF") or "/etc/slurm/slurm.conf"
    if not os.path.isfile(conf):
        raise SlurmUnavailable(
            f"no Slurm configuration at {conf}",
            hint="set SLURM_CONF to your cluster's slurm.conf, or run `ft lab up` for the local lab",
        )
    env["SLURM_CONF"] = conf
    return env


def run(argv: list[str], timeout: float = DEFAULT_TIMEOUT_S, check: bool = True) -> CommandResult:
    """Run a Slurm command; raise SlurmUnavailable when it cannot reach the controller."""
    if shutil.which(argv[0]) is None:
        raise SlurmUnavailable(f"{argv[0]} is not installed on this host",
                               hint="install Slurm's client tools, or run `ft lab up` for the local lab")
    try:
        # errors="replace": a job's comment is any bytes its user set; one that is not UTF-8 must not
        # make every user's `squeue --json` unreadable (the signer, the run targets).
        completed = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout,
                                   env=slurm_env(), stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired as exc:
        raise SlurmUnavailable(f"`{' '.join(argv)}` did not answer within {timeout:.0f} s",
                               hint="is slurmctld running and reachable? (`scontrol ping`)") from exc
    result = CommandResult(tuple(argv), completed.returncode, completed.stdout, completed.stderr)
    if check and completed.returncode != 0:
        message = completed.stderr.strip() or completed.stdout.strip() or f"exit status {completed.returncode}"
        if "Unable to contact slurm controller" in message or "Connection refused" in message:
            raise SlurmUnavailable(f"the Slurm controller is unreachable: {message}",
                                   hint="check `scontrol ping`; for the local lab run `ft lab up`")
        raise SlurmCommandError(f"`{' '.join(argv)}` failed: {message}")
    return result


def run_json(argv: list[str], timeout: float = DEFAULT_TIMEOUT_S, runner: Callable | None = None) -> Any:
    """Run a Slurm command line with --json (added where the caller left it out: without it Slurm
    prints text) and return its parsed output (`runner`: run's stand-in in tests); SlurmCommandError
    where it printed none."""
    if "--json" not in argv:
        argv = [*argv, "--json"]
    result = (runner or run)(argv, timeout=timeout)
    try:
        return json.loads(result.stdout)
    except (ValueError, RecursionError) as exc:
        raise SlurmCommandError(f"`{' '.join(argv[:3])} ...` printed no valid JSON: {exc}") from None
