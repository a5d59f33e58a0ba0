"""The job after its batch host is lost: `python -m toolkit.job --successor-of NODE ...`, a step
on a spare node (or a survivor) started by the first launcher to report the loss
(toolkit/launch/handover.py).

Under --no-kill, Slurm keeps the job RUNNING without the lost node, but its job script died with
it: this program takes the script's place. It adopts the training step as it runs (the lost node
trained on no rank), and the job controller (controller.py) goes on from there as the script's
would: restarts, lost nodes, requeues, out of memory. What only the batch script had, it does
itself: it writes the job's batch log, keeps the time limit (`--signal=B:USR2@...` reaches batch
steps only: the controller is told at that time), and ends the job with the run's exit code
(libslurm's slurm_complete_job: the job would otherwise hold its nodes until its time limit).
It lives as long as its srun client, which the launcher that started it keeps
(toolkit/launch/node.py: wait_for_successor).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

from toolkit.base.errors import FtError
from toolkit.job.controller import JobController, say
from toolkit.job.supervise import Adoption
from toolkit.runs.layout import RunLayout, RunSpecError
from toolkit.slurm.client import CliSlurmClient, SlurmClient

END_TIME_LOOK_S = 30.0  # the time limit asked again this often (an admin may extend it)


def parse(argv: list[str]) -> Adoption:
    parser = argparse.ArgumentParser(prog="python -m toolkit.job", description=__doc__.splitlines()[0])
    parser.add_argument("--successor-of", required=True, metavar="NODE", help="the lost batch host")
    parser.add_argument("--step", required=True, help="the training step to take over (JOB.STEP)")
    parser.add_argument("--start", required=True, type=int, help="the supervisor's start number of that step")
    parser.add_argument("--training", required=True, help="the step's nodes, comma-separated")
    args = parser.parse_args(argv)
    return Adoption(args.successor_of, args.step, [n for n in args.training.split(",") if n], args.start)


def write_batch_log(run_dir: Path, job_id: str) -> None:
    """This process's output into the job's batch log, as the job script's was (appended)."""
    log = RunLayout(run_dir).slurm_log(job_id)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def time_limit_watch(slurm: SlurmClient, job_id: str, before_s: int, stop: threading.Event,
                     on_time_limit) -> None:
    """`on_time_limit(SIGUSR2)` `before_s` seconds before the job's time limit, once: what Slurm's
    USR2 does for the batch script (the ranks checkpoint, and the job requeues itself)."""
    while not stop.is_set():
        try:
            end = slurm.end_time(job_id)
        except FtError:
            end = None
        if end is not None and time.time() >= end - before_s:
            on_time_limit(signal.SIGUSR2)
            return
        wait = END_TIME_LOOK_S if end is None else min(END_TIME_LOOK_S, max(end - before_s - time.time(), 0.5))
        stop.wait(wait)


def still_this_start(slurm: SlurmClient, job_id: str, restarts: int) -> bool:
    """The job runs its same start (not requeued, cancelled or ended meanwhile): this program ends it."""
    try:
        info = slurm.job_brief(job_id)
    except FtError:
        return False
    return info is not None and info.state == "RUNNING" and info.restarts == restarts


# What srun reads from its environment that describes this program's own one-task step, not the
# job: the training steps it starts later must not inherit them (a CPU mask, one CPU a task).
OWN_STEP_VARIABLES = ("SLURM_CPU_BIND", "SLURM_CPU_BIND_LIST", "SLURM_CPU_BIND_TYPE", "SLURM_CPU_BIND_VERBOSE",
                      "SLURM_CPUS_PER_TASK", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_DISTRIBUTION",
                      "SLURM_TRES_PER_TASK")


def main(argv: list[str]) -> int:
    from toolkit.launch import handover

    adoption = parse(argv)
    run_dir, job_id = Path(os.environ["FT_RUN_DIR"]), os.environ["SLURM_JOB_ID"]
    write_batch_log(run_dir, job_id)
    for name in OWN_STEP_VARIABLES:
        os.environ.pop(name, None)
    marks = Path(os.environ["FT_LAUNCH_MARKS"])
    if not handover.claim(marks, adoption.lost, "successor"):  # too late: the reporter requeued the job
        say(f"the survivors gave up waiting for this successor of {adoption.lost} "
            f"({handover.claimed_by(marks, adoption.lost) or 'claimed'}): not taking over")
        return 0
    here, own = os.environ.get("SLURMD_NODENAME", "?"), f"{job_id}.{os.environ.get('SLURM_STEP_ID', '?')}"
    say(f"successor of the lost batch host {adoption.lost} on {here} (step {own}): taking over training step "
        f"{adoption.step_id}")
    slurm = CliSlurmClient()
    controller = JobController(run_dir, slurm, adoption=adoption)
    # A USR2 from outside is not the time limit's (Slurm sends that to batch steps only): srun's
    # client of this step passes on what the training step it sits in gets (the USR2 this program
    # sends it to checkpoint). The time limit is this program's own (time_limit_watch).
    signal.signal(signal.SIGUSR2, lambda signum, frame: None)
    signal.signal(signal.SIGTERM, controller.on_signal)
    stop = threading.Event()
    try:
        before = RunLayout(run_dir).read_spec().recipe.checkpoint.before_time_limit
    except RunSpecError:
        before = None  # the controller says why, and ends
    if before is not None:
        threading.Thread(target=time_limit_watch, args=(slurm, job_id, before, stop, controller.on_signal),
                         daemon=True, name="ft-time-limit").start()
    code = controller.run()
    stop.set()
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    if controller.signal is None and still_this_start(slurm, job_id, restarts):
        say(f"ending job {job_id} with exit code {code} (its job script was lost with {adoption.lost})")
        if not slurm.complete_job(job_id, code):
            say(f"Slurm would not end job {job_id}: cancelling it (libslurm not found, or refused)")
            slurm.cancel([job_id])
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
