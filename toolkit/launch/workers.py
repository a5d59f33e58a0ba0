"""Start this node's training workers and supervise them.

One worker per GPU (or a configured number per node on CPU clusters). When any worker fails, the
others on this node are stopped at once and the launcher exits non-zero naming the rank and node;
srun --kill-on-bad-exit then ends the other nodes' launchers. No job waits for a collective
timeout, and no job with a failed rank exits 0.

With ft's watchdog on, each worker tells its step through a pipe; a rank whose step is late (the
hang rule in toolkit/watch/progress.py) has its Python stacks dumped into the run's logs, and the
node stops with exits.HUNG, which the supervisor restarts from the latest checkpoint. The launcher
heartbeats to the supervisor every second meanwhile (toolkit/watch/heartbeat.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from toolkit.base.shared_dirs import write_atomically
from toolkit.launch import warm
from toolkit.launch.log import log
from toolkit.launch.warm import WarmWorker, runtime_env
from toolkit.runs import exits
from toolkit.runs.layout import RunLayout, RunSpecError
from toolkit.runs.timeline import record
from toolkit.train import cores
from toolkit.watch import stacks
from toolkit.watch.heartbeat import Sender
from toolkit.watch.progress import PROGRESS_FD, HangRule, NodeProgress

HANG_KILL_DELAY_S = 1.0  # see supervise(): the other nodes read their ranks' stacks meanwhile


def worker_env(node_rank: int, local_rank: int, per_node: int, nodes: int, backend: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "RANK": str(node_rank * per_node + local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(per_node * nodes),
        "LOCAL_WORLD_SIZE": str(per_node),
        "NODE_RANK": str(node_rank),
    })
    return runtime_env(env, backend)


def start_workers(layout: RunLayout, node_rank: int, per_node: int, nodes: int, backend: str
                  ) -> tuple[dict[int, subprocess.Popen | WarmWorker], dict[int, int]]:
    """The workers (forked from the node's warm template where the supervisor started one, else new
    processes), and the read end of each one's progress pipe."""
    workers: dict[int, subprocess.Popen | WarmWorker] = {}
    pipes: dict[int, int] = {}
    step_cores = sorted(os.sched_getaffinity(0))
    if warning := cores.shortfall(step_cores, per_node):
        log(warning)
    planned = cores.plan(step_cores, per_node)
    log(f"cores: the step holds {cores.format_cpu_list(step_cores)}; "
        + ", ".join(f"rank {node_rank * per_node + local}: {cores.format_cpu_list(mine)}"
                    for local, mine in enumerate(planned)))
    for local_rank in range(per_node):
        env = worker_env(node_rank, local_rank, per_node, nodes, backend)
        env[cores.RANK_CORES_ENV] = cores.format_cpu_list(planned[local_rank])
        # Thread pools as wide as the rank's share, unless the site says otherwise (DeepSpeed's
        # --bind_cores_to_rank does the same; the default, every core of the node, oversubscribes).
        env.setdefault("OMP_NUM_THREADS", str(len(planned[local_rank])))
        rank = int(env["RANK"])
        read_end, write_end = os.pipe()
        env[PROGRESS_FD] = str(write_end)
        with open(layout.rank_log(rank), "a") as rank_log:
            workers[rank] = warm.spawn(env, rank_log.fileno(), write_end, PROGRESS_FD, say=log) or \
                subprocess.Popen([sys.executable, "-u", "-m", "toolkit.train.worker"], env=env, stdout=rank_log,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, pass_fds=(write_end,))
        os.close(write_end)
        pipes[rank] = read_end
        record_place(layout, rank, workers[rank], env[cores.RANK_CORES_ENV])
    return workers, pipes


def record_place(layout: RunLayout, rank: int, process: subprocess.Popen | WarmWorker, planned_cores: str = "") -> None:
    """Where the rank runs now, for `ft chaos` and for whoever looks (a forked rank's command line
    and environment in /proc are its template's, so they cannot tell)."""
    place = {"node": os.environ.get("SLURMD_NODENAME") or socket.gethostname(), "pid": process.pid,
             "job": os.environ.get("SLURM_JOB_ID", ""), "start": os.environ.get("FT_WATCH_START", ""),
             "warm": isinstance(process, WarmWorker), "cores": planned_cores, "time": time.time()}
    with contextlib.suppress(OSError):
        path = layout.rank_place(rank)
        path.parent.mkdir(exist_ok=True)
        write_atomically(path, json.dumps(place))


def read_progress(pipes: dict[int, int], progress: NodeProgress, lock: threading.Lock) -> None:
    """Until every worker has closed its pipe (exited)."""
    selector = selectors.DefaultSelector()
    for rank, fd in pipes.items():
        selector.register(fd, selectors.EVENT_READ, rank)
    while selector.get_map():
        for key, _ in selector.select(timeout=1.0):
            data = os.read(key.fd, 4096)
            if not data:
                selector.unregister(key.fd)
                os.close(key.fd)
                continue
            with lock:
                progress.feed(key.data, data)


def run_workers(run_dir: Path, node_rank: int, nodes: int, beat: Sender | None = None) -> int:
    """Run this node's workers to the end; `beat`, the node's heartbeat (None without ft's
    watchdog), carries their progress from now on."""
    layout = RunLayout(run_dir)
    try:
        spec = layout.read_spec()
    except RunSpecError as exc:
        print(f"[ft-launch {socket.gethostname()}] {exc}", flush=True)
        RunLayout(run_dir).leave_exit_status(exits.USER_ERROR)
        return exits.USER_ERROR
    host = socket.gethostname()
    layout.logs.mkdir(parents=True, exist_ok=True)
    watchdog = spec.recipe.watchdog
    workers, pipes = start_workers(layout, node_rank, spec.derived.workers_per_node, nodes,
                                   spec.site.distributed_backend)
    progress, lock = NodeProgress(list(workers), HangRule.of(watchdog)), threading.Lock()
    threading.Thread(target=read_progress, args=(pipes, progress, lock), name="ft-progress", daemon=True).start()
    if beat:
        from toolkit.watch.gpus import GpuReader

        gpus = GpuReader.open()  # None without NVML (no GPU, no driver): no GPU metrics

        def state() -> dict:
            with lock:
                ranks = progress.summary()
            return {"ranks": ranks, **({"gpus": gpus.wire()} if gpus else {})}

        beat.state = state

    def forward(signum, _frame):  # the pre-timeout signal: every worker checkpoints and stops
        for process in workers.values():
            if process.poll() is None:
                process.send_signal(signum)

    signal.signal(signal.SIGUSR2, forward)
    signal.signal(signal.SIGTERM, forward)
    return supervise(layout, host, workers, progress, lock, watchdog.enabled, beat.peers_lost if beat else None,
                     lambda: beat.lost if beat else [])


def supervise(layout: RunLayout, host: str, workers: dict[int, subprocess.Popen], progress: NodeProgress,
              lock: threading.Lock, watching: bool, peers_lost: threading.Event | None = None,
              lost: Callable[[], list[str]] = list) -> int:
    while True:
        if peers_lost is not None and peers_lost.is_set():
            # No checkpoint can be taken without the lost node's ranks: stopped now, not after the
            # TERM a requeue brings and the KillWait they would wait out on its collectives.
            print(f"[ft-launch {host}] {', '.join(lost())} lost: stopping this node's ranks at once", flush=True)
            stop(workers, grace=0)
            return 1
        failed = {rank: p.returncode for rank, p in workers.items() if p.poll() not in (None, 0)}
        if failed:
            rank, code = min(failed.items())
            print(f"[ft-launch {host}] rank {rank} on {host} exited {code}; stopping this node's other ranks "
                  f"(log: {layout.rank_log(rank)})", flush=True)
            stop(workers)
            return code if code > 0 else 1
        if all(p.poll() == 0 for p in workers.values()):
            return 0
        with lock:
            hung = progress.hung() if watching else {}
        if hung:
            for rank, why in sorted(hung.items()):
                print(f"[ft-launch {host}] rank {rank} on {host} is hung: {why}", flush=True)
            record_hung(layout, host, hung, workers)
            stacks.dump_all(layout, {rank: p.pid for rank, p in workers.items() if p.poll() is None},
                            lambda line: print(f"[ft-launch {host}] {line}", flush=True))
            # The other nodes' launchers see the same stall within a second or two and read their
            # ranks' stacks: ranks killed here at once would break those ranks' collectives first,
            # and their stacks would show the error instead of where they waited.
            time.sleep(HANG_KILL_DELAY_S)
            stop(workers, grace=0)
            layout.leave_exit_status(exits.HUNG)
            return exits.HUNG
        time.sleep(0.2)


def record_hung(layout: RunLayout, host: str, hung: dict[int, str], workers: dict[int, subprocess.Popen]) -> None:
    """Each hung rank in the run's events, with the blame its state puts on this node (a stopped
    rank, one stuck in the kernel) or none (it may be waiting on another): the supervisor leaves a
    node out that keeps being blamed (watchdog.exclude_after_hangs)."""
    start = int(os.environ.get("FT_WATCH_START", "0") or 0)
    for rank, why in sorted(hung.items()):
        blamed = stacks.blame(workers[rank].pid)
        with contextlib.suppress(OSError):
            record(layout.root, "rank_hung", node=os.environ.get("SLURMD_NODENAME") or host, rank=rank,
                   start=start, why=why, blamed=blamed)


def stop(workers: dict[int, subprocess.Popen], grace: float = 5.0) -> None:
    for process in workers.values():
        if process.poll() is None:
            process.terminate() if grace else process.kill()
    deadline = time.monotonic() + grace
    for process in workers.values():
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
