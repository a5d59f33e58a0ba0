"""ft's per-node launcher, started by srun once per node.

It checks in with the other nodes (a barrier at the first node), records the attempt in the run
directory, then either runs the preflight checks (FT_MODE=preflight) or starts the training
workers. Exit status: 0 done, 1 failed (Slurm may requeue), 3 the node cannot run ft at all.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

from toolkit.launch.rendezvous import RendezvousError, barrier, job_secret
from toolkit.runs.layout import RunLayout, RunSpecError
from toolkit.watch.heartbeat import Sender

EXIT_FAILED = 1
EXIT_NODE_UNFIT = 3


def step_placement() -> tuple[int, int]:
    """This node's rank among the step's nodes, and their number: one launcher per node, so the
    task's rank in the step. (The allocation may hold spare nodes that the step does not use.)"""
    return (int(os.environ.get("SLURM_PROCID", os.environ.get("SLURM_NODEID", "0"))),
            int(os.environ.get("SLURM_NTASKS", os.environ.get("SLURM_JOB_NUM_NODES", "1"))))


def log(message: str) -> None:
    print(f"[ft-launch {socket.gethostname()} {time.strftime('%H:%M:%S')}] {message}", flush=True)


def record_attempt(run_dir: Path, job_id: str, restart: int, nodes: list[str]) -> None:
    """One line per start of the job (requeues included): what `ft status` lists as attempts."""
    entry = {"job_id": job_id, "restart": restart, "start": int(os.environ.get("FT_WATCH_START", "1")),
             "nodes": nodes, "started": time.time()}
    with open(RunLayout(run_dir).attempts, "a") as handle:
        handle.write(json.dumps(entry) + "\n")


def preflight(run_dir: Path) -> int:
    """Checks a node must pass before an allocation is worth training on."""
    problems = []
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    expected = int(os.environ.get("SLURM_GPUS_ON_NODE", "0") or 0)
    if len(visible) != expected:
        problems.append(f"{len(visible)} GPUs visible, {expected} allocated")
    layout = RunLayout(run_dir)
    try:
        recipe_env = layout.read_spec().recipe.env
    except RunSpecError as exc:
        problems.append(exc.message)
        recipe_env = {}
    # What this node sees: the recipe's environment arrives exactly as written, or the check fails.
    env_seen = {name: os.environ.get(name) for name in recipe_env}
    for name, value in recipe_env.items():
        if env_seen[name] != value:
            problems.append(f"environment variable {name} differs from the recipe's value")
    probe = layout.preflight / socket.gethostname()
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


def start_heartbeat(node: str) -> Sender | None:
    """This node's heartbeat to the supervisor, from the launcher's first second (None when ft's
    watchdog is off: no supervisor listens)."""
    address, port = os.environ.get("FT_WATCH_ADDR"), os.environ.get("FT_WATCH_PORT", "")
    if not address or not port.isdigit():
        return None
    silence = float(os.environ.get("FT_WATCH_TIMEOUT", "10"))
    sender = Sender(address, int(port), job_secret(), node, int(os.environ.get("FT_WATCH_START", "0")),
                    state=dict, silence_s=silence)
    sender.on_silence = lambda quiet: batch_host_lost(node, quiet, silence, still_quiet=sender.unanswered)
    return sender.start()


def slurmd_answers(address: str) -> bool:
    """Whether the batch host's slurmd accepts a connection: a second opinion beside the heartbeats
    (which a flood of junk could drown), before a node is called lost. On the SlurmdPort the
    supervisor read (a launcher may run in a container without Slurm's commands); none known: no
    sign of loss."""
    from toolkit.slurm.nodes import slurmd_answers as answers

    port = os.environ.get("FT_WATCH_SLURMD_PORT", "")
    return answers(address, int(port)) if port.isdigit() else True


def first_to_report(marks: str | None, what: str) -> bool:
    """Every surviving node hears the batch host go quiet: the first to leave its mark for `what`
    acts, the others leave it to that one (without the marks folder, or where it fails, each acts).
    The folder is this start of the job's own: a requeued job starts with a new one."""
    if not marks:
        return True
    try:
        os.close(os.open(Path(marks) / what, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return False
    except OSError:
        return True
    return True


# This launcher asked Slurm to requeue the job (its batch host lost): it lifts Slurm's hold on the
# requeued job as it ends.
REQUEUED_AT: list[float] = []  # when it asked (time.monotonic()): Slurm's TERM follows at once


def batch_host_lost(node: str, quiet: float, timeout: float = float("inf"),
                    still_quiet: Callable[[], bool] = lambda: True) -> bool:
    """The supervisor stopped answering for `quiet` seconds: where its node's slurmd does not answer
    either, the node (the batch host) is lost, and the job with it. Slurm would notice only after
    SlurmdTimeout; one surviving node tells it now: the job requeued and the node marked DOWN (with
    the reason). A supervisor quiet on a live node (a launcher of an earlier start it no longer
    answers, a node that rebooted already) is asked about again until the heartbeat `timeout`, then
    left to Slurm to judge; where Slurm requeues the job for it, the job starts again at once all the
    same. True once the silence is judged (toolkit/watch/heartbeat.py's Sender asks no more).
    `still_quiet()` is asked again before each step: an answer meanwhile (this node's own link back
    after a flap) ends it, and no healthy batch host is marked DOWN."""
    from toolkit.runs.timeline import record
    from toolkit.slurm.client import CliSlurmClient
    from toolkit.watch.requeue import retried

    batch_host, job = os.environ.get("FT_WATCH_NODE", ""), os.environ.get("SLURM_JOB_ID", "")
    if not batch_host or batch_host == node or not job:
        return True
    marks = os.environ.get("FT_LAUNCH_MARKS")
    if slurmd_answers(os.environ.get("FT_WATCH_ADDR", batch_host)):
        if quiet < timeout:
            return False
        log(f"the supervisor on {batch_host} did not answer for {quiet:.0f} s, but the node's slurmd does: "
            "left to Slurm")
        return True
    if not still_quiet():
        return False
    if not first_to_report(marks, "batch-host-lost"):
        log(f"the batch host {batch_host} did not answer for {quiet:.1f} s: another node reports it")
        return True
    why = (f"ft: batch host of job {job} (run {os.environ.get('FT_RUN_ID', '?')}) lost: its supervisor did not "
           f"answer for {quiet:.1f} s, nor its slurmd")
    # Slurm requeues a job for its DOWN node by itself, except a job that holds spare nodes
    # (--no-kill): that one it keeps running without its batch script, for good (seen on the lab).
    # So both, in this order: the requeue first (its TERM this launcher handles), then the mark
    # (with the mark first, or both at once, the requeue was sometimes never sent, and the job ran
    # on without its script). This launcher then lifts Slurm's hold on the job as it ends.
    log(f"{why}: requeueing job {job} and marking {batch_host} DOWN")
    if os.environ.get("FT_RUN_DIR"):
        with contextlib.suppress(OSError):
            record(Path(os.environ["FT_RUN_DIR"]), "node_lost", node=batch_host, reason=why, reported_by=node)
    slurm = CliSlurmClient()
    REQUEUED_AT.append(time.monotonic())
    requeued = retried(lambda: slurm.requeue(job), f"requeueing job {job}")
    if not still_quiet():  # the requeue stands (the job resumes from its checkpoint); the node is sound
        log(f"the supervisor on {batch_host} answers again: not marking it DOWN")
        return True
    marked = retried(lambda: slurm.mark_node_down(batch_host, why), f"marking {batch_host} DOWN")
    if marked:  # the launcher stays as the job's last process a while: long enough for the looks
        from toolkit.watch.silence import keep_down

        address = os.environ.get("FT_WATCH_ADDR", batch_host)
        keep_down(slurm, batch_host, why, lambda: not slurmd_answers(address), log)
    if not requeued and not marked:
        log(f"Slurm took neither (operator rights?): it requeues job {job} once it notices (SlurmdTimeout)")
    return True


def lift_requeue_hold() -> None:
    """This launcher saw the job requeued for its lost batch host: it stays as the job's last process
    on its node and lifts Slurm's hold (toolkit/watch/requeue.py), then ends."""
    from toolkit.runs.timeline import record
    from toolkit.slurm.client import CliSlurmClient
    from toolkit.watch.requeue import stay_as_last

    job, run_dir = os.environ.get("SLURM_JOB_ID", ""), os.environ.get("FT_RUN_DIR")

    def lifted() -> None:
        if run_dir:
            record(Path(run_dir), "requeue_hold_lifted", after=1)

    if job:
        stay_as_last(CliSlurmClient(), job, on_lifted=lifted, terminated_at=REQUEUED_AT[0])


def train(run_dir: Path, node_rank: int, nodes: int, beat: Sender | None) -> int:
    try:
        from toolkit.train.workers import run_workers  # the training runtime (ft[train])
    except ImportError as exc:
        log(f"the training runtime is not installed on this node ({exc}); install ft[train]")
        return EXIT_NODE_UNFIT
    return run_workers(run_dir, node_rank, nodes, beat)


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
    node_rank, nodes = step_placement()
    host = socket.gethostname()
    log(f"node {node_rank}/{nodes} mode={mode} job={os.environ.get('SLURM_JOB_ID')}")
    beat = start_heartbeat(os.environ.get("SLURMD_NODENAME") or host)
    code = run_node(run_dir, mode, node_rank, nodes, host, beat)
    if beat:
        beat.stop(code, linger=0 if REQUEUED_AT else beat.silence_s + 2 if code else 0)
    if REQUEUED_AT and code != 0:  # ended by Slurm's TERM: the requeue (or a cancel)
        lift_requeue_hold()
    sys.exit(code)


def run_node(run_dir: Path, mode: str, node_rank: int, nodes: int, host: str, beat: Sender | None) -> int:
    try:
        arrived = barrier(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")),
                          node_rank, nodes, host, log=log)
    except RendezvousError as exc:
        log(str(exc))
        return EXIT_FAILED
    if node_rank == 0:
        record_attempt(run_dir, os.environ.get("SLURM_JOB_ID", ""), int(os.environ.get("SLURM_RESTART_COUNT", "0")),
                       [host, *(arrived[rank] for rank in sorted(arrived))])
        log(f"all {nodes} nodes checked in: {', '.join([host, *arrived.values()])}")
    return preflight(run_dir) if mode == "preflight" else train(run_dir, node_rank, nodes, beat)
