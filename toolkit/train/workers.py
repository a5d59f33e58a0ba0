"""Start this node's training workers and supervise them.

One worker per GPU (or a configured number per node on CPU clusters). When any worker fails, the
others on this node are stopped at once and the launcher exits non-zero naming the rank and node;
srun --kill-on-bad-exit then ends the other nodes' launchers. No job waits for a collective
timeout, and no job with a failed rank exits 0.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

EXIT_USER_ERROR = 4  # the recipe or the data is wrong (NaN loss...): requeueing would not help
EXIT_OUT_OF_MEMORY = 5  # the job script retries once with a smaller micro batch (same global batch)


def worker_env(node_rank: int, local_rank: int, per_node: int, nodes: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "RANK": str(node_rank * per_node + local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(per_node * nodes),
        "LOCAL_WORLD_SIZE": str(per_node),
        "NODE_RANK": str(node_rank),
    })
    if env.get("FT_DIST_BACKEND") == "gloo":
        env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def run_workers(run_dir: Path) -> int:
    per_node = int(os.environ.get("FT_WORKERS_PER_NODE", "1"))
    node_rank = int(os.environ.get("SLURM_NODEID", "0"))
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
    host = socket.gethostname()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    workers: dict[int, subprocess.Popen] = {}
    for local_rank in range(per_node):
        env = worker_env(node_rank, local_rank, per_node, nodes)
        rank = int(env["RANK"])
        with open(run_dir / "logs" / f"rank-{rank}.log", "a") as log:
            workers[rank] = subprocess.Popen([sys.executable, "-u", "-m", "toolkit.train.worker"], env=env,
                                             stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def forward(signum, _frame):  # the pre-timeout signal: every worker checkpoints and stops
        for process in workers.values():
            if process.poll() is None:
                process.send_signal(signum)

    signal.signal(signal.SIGUSR2, forward)
    signal.signal(signal.SIGTERM, forward)
    while True:
        failed = {rank: p.returncode for rank, p in workers.items() if p.poll() not in (None, 0)}
        if failed:
            rank, code = min(failed.items())
            print(f"[ft-launch {host}] rank {rank} on {host} exited {code}; stopping this node's other ranks "
                  f"(log: {run_dir / 'logs' / f'rank-{rank}.log'})", flush=True)
            stop(workers)
            return code if code > 0 else 1
        if all(p.poll() == 0 for p in workers.values()):
            return 0
        time.sleep(0.2)


def stop(workers: dict[int, subprocess.Popen], grace: float = 5.0) -> None:
    for process in workers.values():
        if process.poll() is None:
            process.terminate()
    deadline = time.monotonic() + grace
    for process in workers.values():
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
