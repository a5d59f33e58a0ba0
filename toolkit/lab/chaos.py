"""Faults on purpose, on the lab: what `ft chaos` does to a running ft run, for users trying ft's
recovery and for the tests. A rank is found by its run and rank among the lab nodes' processes."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import FtError
from toolkit.lab.lifecycle import crash, require_root
from toolkit.lab.manifest import LabManifest, state_dir
from toolkit.lab.processes import netns_pids


@dataclass(frozen=True)
class RankProcess:
    node: str
    pid: int


def find_rank(run_id: str, rank: int) -> RankProcess:
    """The worker process of one rank of a run, on whichever lab node it runs."""
    require_root("chaos")
    manifest = LabManifest.load()
    if manifest is None:
        raise FtError("there is no lab on this machine", hint="run `ft lab up` first")
    wanted = {f"FT_RUN_ID={run_id}".encode(), f"RANK={rank}".encode()}
    for node in manifest.nodes:
        for pid in netns_pids(node.netns):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                environ = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
            except OSError:
                continue  # ended meanwhile
            if b"toolkit.train.worker" in cmdline and wanted <= environ:
                return RankProcess(node.name, pid)
    raise FtError(f"no rank {rank} of run {run_id} is running on the lab",
                  hint="is the run training? (`ft status`; ranks start after the model loads)")


def hang_rank(run_id: str, rank: int) -> RankProcess:
    """Stop a rank (SIGSTOP): it holds its collectives, as a rank stuck in a driver call would."""
    found = find_rank(run_id, rank)
    os.kill(found.pid, signal.SIGSTOP)
    return found


def kill_rank(run_id: str, rank: int) -> RankProcess:
    found = find_rank(run_id, rank)
    os.kill(found.pid, signal.SIGKILL)
    return found


def crash_rank_node(run_id: str, rank: int) -> RankProcess:
    """Crash the node a rank runs on: every process of the node ends, slurmd included."""
    found = find_rank(run_id, rank)
    crash(found.node)
    return found


def fail_gpu(run_id: str, rank: int) -> tuple[RankProcess, Path]:
    """A GPU falls off the bus on the node a rank runs on. The lab's GPUs are device files (gres.conf
    names them, as /dev/nvidiaN on a real node): one goes, and the node's own health check
    (HealthCheckProgram, every few seconds on the lab) drains it, as it would a real node; ft's
    watchdog then sees the drain. `ft lab up` puts the device back, and the health check resumes
    the node it drained."""
    found = find_rank(run_id, rank)
    devices = sorted((state_dir() / "dev" / found.node).glob("nvidia[0-9]*"))
    if not devices:
        raise FtError(f"{found.node} has no GPU device left to fail", hint="`ft lab up` puts them back")
    devices[-1].unlink()
    return found, devices[-1]
