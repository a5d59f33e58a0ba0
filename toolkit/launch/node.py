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
from dataclasses import dataclass
from pathlib import Path

from toolkit.launch.log import log
from toolkit.launch.rendezvous import RendezvousError, barrier, job_secret
from toolkit.runs import exits
from toolkit.runs.layout import BATCH_HOST_LOST, REQUEUED_FOR, RunLayout, RunSpecError
from toolkit.watch.heartbeat import Sender


def step_placement() -> tuple[int, int]:
    """This node's rank among the step's nodes, and their number: one launcher per node, so the
    task's rank in the step. (The allocation may hold spare nodes that the step does not use.)"""
    return (int(os.environ.get("SLURM_PROCID", os.environ.get("SLURM_NODEID", "0"))),
            int(os.environ.get("SLURM_NTASKS", os.environ.get("SLURM_JOB_NUM_NODES", "1"))))


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
    return exits.NODE_UNFIT if problems else 0


@dataclass
class Watched:
    """The supervisor this launcher's heartbeats go to: the batch host's, then a successor's."""
    node: str
    address: str


WATCHED = Watched("", "")  # set by a retarget to a successor


def watched() -> Watched:
    """Where the heartbeats go: the job's supervisor (FT_WATCH_NODE, FT_WATCH_ADDR) until a successor."""
    if WATCHED.node:
        return WATCHED
    node = os.environ.get("FT_WATCH_NODE", "")
    return Watched(node, os.environ.get("FT_WATCH_ADDR", "") or node)


def start_heartbeat(node: str) -> Sender | None:
    """This node's heartbeat to the supervisor, from the launcher's first second (None when ft's
    watchdog is off: no supervisor listens)."""
    address, port = os.environ.get("FT_WATCH_ADDR"), os.environ.get("FT_WATCH_PORT", "")
    if not address or not port.isdigit():
        return None
    silence = float(os.environ.get("FT_WATCH_TIMEOUT", "10"))
    sender = Sender(address, int(port), job_secret(), node, int(os.environ.get("FT_WATCH_START", "0")),
                    state=dict, silence_s=silence)
    sender.on_silence = lambda quiet: batch_host_lost(node, quiet, silence, still_quiet=sender.unanswered,
                                                      sender=sender)
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
SILENT_AFTER: list[str] = []  # the batch host, still silent after the requeue: its srun clients lost
# The looks at the lost node Slurm may take back on a stale word (toolkit/watch/silence.py): threads of
# this process, which the launcher waits for before it ends (its ranks stopped, it would end first).
KEEPING_DOWN: list = []
KEEP_DOWN_WAIT_S = 5.0  # the last look (3 s after the mark) and a slow answer of Slurm's
# How long a survivor that did not report the batch host's loss waits for the reporter's requeue:
# three tries of a busy controller's `scontrol requeue`, and some.
REQUEUE_MARK_WAIT_S = 30.0
# The srun clients of the successors this launcher started: their steps live as long as they do.
SUCCESSORS: list = []


def batch_host_lost(node: str, quiet: float, timeout: float = float("inf"),
                    still_quiet: Callable[[], bool] = lambda: True, sender: Sender | None = None) -> bool:
    """The supervisor stopped answering for `quiet` seconds: where its node's slurmd does not answer
    either, the node (the batch host, or a successor's) is lost. Slurm would notice only after
    SlurmdTimeout; one surviving node tells it now. Where the lost node trained on no rank (a spare:
    the job holds it --no-kill), the job goes on: the node marked DOWN, and a successor takes the
    job script's place (toolkit/launch/handover.py); else the job is requeued and the node marked
    DOWN (with the reason). A supervisor quiet on a live node (a launcher of an earlier start it no
    longer answers, a node that rebooted already) is asked about again until the heartbeat
    `timeout`, then left to Slurm to judge; where Slurm requeues the job for it, the job starts
    again at once all the same. True once the silence is judged (toolkit/watch/heartbeat.py's
    Sender asks no more). `still_quiet()` is asked again before each step: an answer meanwhile
    (this node's own link back after a flap) ends it, and no healthy batch host is marked DOWN."""
    from toolkit.runs.timeline import record

    batch_host, job = watched().node, os.environ.get("SLURM_JOB_ID", "")
    if not batch_host or batch_host == node or not job:
        return True
    marks = os.environ.get("FT_LAUNCH_MARKS")
    if slurmd_answers(watched().address):
        if quiet < timeout:
            return False
        log(f"the supervisor on {batch_host} did not answer for {quiet:.0f} s, but the node's slurmd does: "
            "left to Slurm")
        return True
    if not still_quiet():
        return False
    training = training_nodes()
    survivable = bool(marks) and bool(training) and batch_host not in training and sender is not None
    if not first_to_report(marks, BATCH_HOST_LOST.format(node=batch_host)):
        log(f"the batch host {batch_host} did not answer for {quiet:.1f} s: another node reports it")
        if batch_host in training and sender is not None and requeue_asked(Path(marks) if marks else None,
                                                                           batch_host):
            sender.peers_gone([batch_host])  # as the reporter's own: see requeue_for_lost
        # Following a successor, a silence later is its loss: judged afresh (False: asked again).
        return not (survivable and follow_successor(sender, Path(marks), batch_host))
    why = (f"ft: batch host of job {job} (run {os.environ.get('FT_RUN_ID', '?')}) lost: its supervisor did not "
           f"answer for {quiet:.1f} s, nor its slurmd")
    if os.environ.get("FT_RUN_DIR"):
        with contextlib.suppress(OSError):
            record(Path(os.environ["FT_RUN_DIR"]), "node_lost", node=batch_host, reason=why, reported_by=node)
    if survivable and succeed(node, batch_host, why, sender, Path(marks), training):
        return False  # the successor's own silence, should it come, is judged afresh
    requeue_for_lost(node, batch_host, why, still_quiet, sender if batch_host in training else None)
    return True


def requeue_asked(marks: Path | None, batch_host: str) -> bool:
    """Whether the reporter of the batch host's loss had the job requeued (its mark), waiting for
    the word a while (REQUEUE_MARK_WAIT_S): its requeue may take Slurm some seconds."""
    if marks is None:
        return False
    mark, deadline = marks / REQUEUED_FOR.format(node=batch_host), time.monotonic() + REQUEUE_MARK_WAIT_S
    while not mark.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def training_nodes() -> list[str]:
    """The nodes this start trains on (the supervisor names them: FT_WATCH_NODES)."""
    return [name for name in os.environ.get("FT_WATCH_NODES", "").split(",") if name]


def succeed(node: str, batch_host: str, why: str, sender: Sender, marks: Path,
            training: list[str]) -> bool:
    """The lost node trained on no rank: it is marked DOWN (Slurm then takes it out of the job, which
    runs on: --no-kill), and a successor started on a spare, or here. True once the successor took
    over (the heartbeats go to it); False where it did not come, or Slurm would not start it."""
    from toolkit.launch import handover
    from toolkit.runs.timeline import record
    from toolkit.slurm.client import CliSlurmClient
    from toolkit.watch.requeue import retried

    slurm, job, lost_address = CliSlurmClient(), os.environ["SLURM_JOB_ID"], watched().address
    log(f"{why}: marking {batch_host} DOWN; the job goes on without it (training does not use it)")
    marked = retried(lambda: slurm.mark_node_down(batch_host, why), f"marking {batch_host} DOWN")
    if not marked:  # the job goes on all the same: Slurm takes the node out of it after SlurmdTimeout
        log(f"marking {batch_host} DOWN needs Slurm operator rights: Slurm marks it after SlurmdTimeout")
    where = handover.successor_node(slurm, job, training, batch_host, node)
    step = f"{job}.{os.environ.get('SLURM_STEP_ID', '0')}"
    log(f"starting a successor to the job script on {where}; it takes over training step {step}")
    errors = RunLayout(Path(os.environ["FT_RUN_DIR"])).successor_srun_errors(node)
    try:
        successor = handover.start_successor(job, where, batch_host, step, os.environ.get("FT_WATCH_START", "0"),
                                             training, errors)
    except OSError as exc:
        log(f"could not start a successor ({exc}): requeueing instead")
        return False
    found = handover.wait_for_handover(marks, batch_host, alive=lambda: successor.poll() is None)
    if found is None and not handover.claim(marks, batch_host, "abandoned"):  # it is taking over: a while more
        found = handover.wait_for_handover(marks, batch_host, alive=lambda: successor.poll() is None)
    if found is None:
        log(f"the successor on {where} did not take over within {handover.HANDOVER_WAIT_S:.0f} s "
            f"(see {errors}): requeueing instead")
        with contextlib.suppress(OSError):
            successor.kill()
        return False
    # Slurm ends a step whose srun client goes away on a live node (its connections closed: seen on
    # the lab within 0.1 s), unlike one whose client's node died: this launcher keeps the client,
    # and waits for it before it ends (wait_for_successor).
    SUCCESSORS.append(successor)
    retarget(sender, found)
    with contextlib.suppress(OSError):
        record(Path(os.environ["FT_RUN_DIR"]), "successor", lost=batch_host, node=found.node, reported_by=node)
    if marked:
        from toolkit.watch.silence import keep_down

        keep_down(slurm, batch_host, why, lambda: not slurmd_answers(lost_address), log)
    return True


def follow_successor(sender: Sender, marks: Path, lost: str) -> bool:
    """Another launcher reports the loss: this one waits for the successor's word, and retargets.
    False where none came (the reporter requeues the job instead)."""
    from toolkit.launch import handover

    found = handover.wait_for_handover(marks, lost, wait_s=2 * handover.HANDOVER_WAIT_S,
                                       alive=lambda: handover.claimed_by(marks, lost) != "abandoned")
    if found is None:
        return False
    retarget(sender, found)
    return True


def retarget(sender: Sender, found) -> None:
    WATCHED.node, WATCHED.address = found.node, found.address
    sender.retarget(found.address, found.port)
    log(f"heartbeats now go to the successor on {found.node} ({found.address}:{found.port})")


def requeue_for_lost(node: str, batch_host: str, why: str, still_quiet: Callable[[], bool],
                     sender: Sender | None = None) -> None:
    """The job requeued, and the lost node marked DOWN. `sender`: where the lost node trained ranks
    of this start, whose loss stops this node's ranks once the requeue is asked."""
    from toolkit.slurm.client import CliSlurmClient
    from toolkit.watch.requeue import retried

    job = os.environ["SLURM_JOB_ID"]
    # Slurm requeues a job for its DOWN node by itself, except a job that holds spare nodes
    # (--no-kill): that one it keeps running without its batch script, for good (seen on the lab).
    # So both, in this order: the requeue first (its TERM this launcher handles), then the mark
    # (with the mark first, or both at once, the requeue was sometimes never sent, and the job ran
    # on without its script). This launcher then lifts Slurm's hold on the job as it ends.
    log(f"{why}: requeueing job {job} and marking {batch_host} DOWN")
    slurm = CliSlurmClient()
    REQUEUED_AT.append(time.monotonic())
    requeued = retried(lambda: slurm.requeue(job), f"requeueing job {job}")
    lost = still_quiet()
    if requeued and lost:
        # No checkpoint can be taken without the lost node's ranks, and a node without power closes
        # none of their connections: the ranks here (and on the other survivors, told by a mark)
        # would wait in their collectives, the requeue's TERM (a checkpoint) included, until Slurm's
        # KILL. Stopped now; not where the requeue was refused, nor where the host answers again
        # (a flap: its ranks may still take the TERM's checkpoint).
        first_to_report(os.environ.get("FT_LAUNCH_MARKS"), REQUEUED_FOR.format(node=batch_host))
        SILENT_AFTER.append(batch_host)
        if sender is not None:
            sender.peers_gone([batch_host])
    if not lost:  # the requeue stands (the job resumes from its checkpoint); the node is sound
        log(f"the supervisor on {batch_host} answers again: not marking it DOWN")
        return
    marked = retried(lambda: slurm.mark_node_down(batch_host, why), f"marking {batch_host} DOWN")
    if marked:  # the launcher stays as the job's last process a while: long enough for the looks
        from toolkit.watch.silence import keep_down

        address = watched().address
        KEEPING_DOWN.append(keep_down(slurm, batch_host, why, lambda: not slurmd_answers(address), log))
    if not requeued and not marked:
        log(f"Slurm took neither (operator rights?): it requeues job {job} once it notices (SlurmdTimeout)")


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

    if job:  # the steps' srun clients ran on the batch host: lost with it, unless it answered again
        stay_as_last(CliSlurmClient(), job, on_lifted=lifted, terminated_at=REQUEUED_AT[0],
                     clients_lost=bool(SILENT_AFTER))


def train(run_dir: Path, node_rank: int, nodes: int, beat: Sender | None) -> int:
    try:
        from toolkit.launch.workers import run_workers  # the training runtime (ft[train])
    except ImportError as exc:
        log(f"the training runtime is not installed on this node ({exc}); install ft[train]")
        return exits.NODE_UNFIT
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
    for looks in KEEPING_DOWN:
        looks.join(timeout=KEEP_DOWN_WAIT_S)
    if REQUEUED_AT and code != 0:  # ended by Slurm's TERM: the requeue (or a cancel)
        lift_requeue_hold()
    wait_for_successor()
    sys.exit(code)


def wait_for_successor() -> None:
    """A successor this launcher started lives as long as its srun client, a child of this process
    in the training step, which ends as this process does: so the launcher stays until the successor
    has ended the job (or requeued it, or stood down). Its step's end ends the wait."""
    for successor in SUCCESSORS:
        if successor.poll() is None:
            log("waiting for the successor's step (it ends the job) before this launcher ends")
            successor.wait()


def run_node(run_dir: Path, mode: str, node_rank: int, nodes: int, host: str, beat: Sender | None) -> int:
    try:
        arrived = barrier(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")),
                          node_rank, nodes, host, log=log)
    except RendezvousError as exc:
        log(str(exc))
        return exits.LAUNCH_FAILED
    if node_rank == 0:
        record_attempt(run_dir, os.environ.get("SLURM_JOB_ID", ""), int(os.environ.get("SLURM_RESTART_COUNT", "0")),
                       [host, *(arrived[rank] for rank in sorted(arrived))])
        log(f"all {nodes} nodes checked in: {', '.join([host, *arrived.values()])}")
    return preflight(run_dir) if mode == "preflight" else train(run_dir, node_rank, nodes, beat)
