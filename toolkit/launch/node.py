"""ft's per-node launcher, started by srun once per node.

It checks in with the other nodes (a barrier at the first node), records the attempt in the run
directory, then either runs the preflight checks (FT_MODE=preflight) or starts the training
workers. Exit status: 0 done, 1 failed (Slurm may requeue), 3 the node cannot run ft at all.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from toolkit.launch.rendezvous import RendezvousError, barrier

EXIT_FAILED = 1
EXIT_NODE_UNFIT = 3


def log(message: str) -> None:
    print(f"[ft-launch {socket.gethostname()} {time.strftime('%H:%M:%S')}] {message}", flush=True)


def record_attempt(run_dir: Path, job_id: str, restart: int, nodes: list[str]) -> None:
    """One line per start of the job (requeues included): what `ft status` lists as attempts."""
    entry = {"job_id": job_id, "restart": restart, "nodes": nodes, "started": time.time()}
    with open(run_dir / "attempts.jsonl", "a") as handle:
        handle.write(json.dumps(entry) + "\n")


def preflight(run_dir: Path) -> int:
    """Checks a node must pass before an allocation is worth training on."""
    problems = []
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    expected = int(os.environ.get("SLURM_GPUS_ON_NODE", "0") or 0)
    if len(visible) != expected:
        problems.append(f"{len(visible)} GPUs visible, {expected} allocated")
    try:
        recipe = json.loads((run_dir / "recipe.json").read_text())
    except (OSError, ValueError) as exc:
        problems.append(f"recipe unreadable: {exc}")
        recipe = {"env": {}}
    # What this node sees: the recipe's environment arrives exactly as written, or the check fails.
    env_seen = {name: os.environ.get(name) for name in recipe.get("env", {})}
    for name, value in recipe.get("env", {}).items():
        if env_seen[name] != value:
            problems.append(f"environment variable {name} differs from the recipe's value")
    probe = run_dir / "preflight" / socket.gethostname()
    try:
        probe.parent.mkdir(parents=True, exist_ok=True)
        probe.write_text(json.dumps({"gpus": visible, "env": env_seen, "time": time.time()}))
    except OSError as exc:
        problems.append(f"run directory not writable: {exc}")
    for problem in problems:
        log(f"preflight: {problem}")
    if not problems:
        log(f"preflight passed: {len(visible)} GPUs, shared run directory writable")
    return EXIT_NODE_UNFIT if problems else 0


def train(run_dir: Path) -> int:
    try:
        from toolkit.train.workers import run_workers  # the training runtime (ft[train])
    except ImportError as exc:
        log(f"the training runtime is not installed on this node ({exc}); install ft[train]")
        return EXIT_NODE_UNFIT
    return run_workers(run_dir)


def leave_launch_mark() -> None:
    """Say this node's launcher started: the job script tells a node lost before the step ran on it
    (no mark) from a failure of the run itself."""
    marks = os.environ.get("FT_LAUNCH_MARKS")
    if marks:
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        (Path(marks) / node).touch()


def main() -> None:
    leave_launch_mark()
    run_dir = Path(os.environ["FT_RUN_DIR"])
    mode = os.environ.get("FT_MODE", "train")
    node_rank = int(os.environ.get("SLURM_NODEID", "0"))
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
    host = socket.gethostname()
    log(f"node {node_rank}/{nodes} mode={mode} job={os.environ.get('SLURM_JOB_ID')}")
    try:
        arrived = barrier(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")),
                          node_rank, nodes, host, log=log)
    except RendezvousError as exc:
        log(str(exc))
        sys.exit(EXIT_FAILED)
    if node_rank == 0:
        record_attempt(run_dir, os.environ.get("SLURM_JOB_ID", ""), int(os.environ.get("SLURM_RESTART_COUNT", "0")),
                       [host, *(arrived[rank] for rank in sorted(arrived))])
        log(f"all {nodes} nodes checked in: {', '.join([host, *arrived.values()])}")
    sys.exit(preflight(run_dir) if mode == "preflight" else train(run_dir))
