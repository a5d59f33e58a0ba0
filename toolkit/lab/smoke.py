"""A 2-node smoke job submitted through submitit: proves the lab serves multi-node GPU jobs."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from dataclasses import dataclass

from toolkit.base.errors import FtError
from toolkit.base.paths import state_home
from toolkit.slurm import commands
from toolkit.slurm.client import CliSlurmClient
from toolkit.slurm.commands import SlurmCommandError, SlurmUnavailable


def describe_task() -> dict:
    """Runs on every task of the job: what host, address and GPUs it got."""
    addresses = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=False).stdout.split()
    return {
        "rank": int(os.environ.get("SLURM_PROCID", "0")),
        "node": os.environ.get("SLURMD_NODENAME", ""),
        "hostname": socket.gethostname(),
        "address": addresses[0] if addresses else "",
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "gpus_on_node": os.environ.get("SLURM_GPUS_ON_NODE", ""),
    }


@dataclass
class SmokeResult:
    job_id: str
    state: str
    tasks: list[dict]
    seconds: float

    @property
    def distinct_hosts(self) -> int:
        return len({task["hostname"] for task in self.tasks})


def run_smoke(nodes: int = 2, gpus_per_node: int = 2, partition: str = "standard",
              timeout_s: float = 300) -> SmokeResult:
    import submitit  # imported here: only this command needs it

    folder = state_home() / "lab-smoke" / "%j"
    executor = submitit.AutoExecutor(folder=folder, cluster="slurm")
    executor.update_parameters(
        name="ft-lab-smoke", nodes=nodes, tasks_per_node=1, slurm_gpus_per_node=gpus_per_node,
        slurm_partition=partition, timeout_min=5, cpus_per_task=1, mem_gb=1,
    )
    started = time.monotonic()
    os.environ.setdefault("SLURM_CONF", commands.slurm_env()["SLURM_CONF"])
    job = executor.submit(describe_task)
    # submitit polls sacct lazily; Slurm's own view says when the job is over.
    client, state = CliSlurmClient(), "PENDING"
    while time.monotonic() - started < timeout_s:
        info = client.job(job.job_id)
        state = info.state if info else state
        if info and info.finished:
            break
        time.sleep(0.5)
    else:
        with contextlib.suppress(SlurmUnavailable, SlurmCommandError):
            client.cancel([job.job_id])
        raise FtError(f"smoke job {job.job_id} did not finish within {timeout_s:.0f} s (last state {state})",
                      hint="see `ft lab status` and the Slurm logs in /var/log/slurm")
    if state != "COMPLETED":
        raise FtError(f"smoke job {job.job_id} ended {state}", hint=f"its logs are in {folder}")
    tasks = sorted(job.results(), key=lambda task: task["rank"])
    return SmokeResult(job.job_id, state, tasks, time.monotonic() - started)
