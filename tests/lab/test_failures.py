"""Failure is normal: a crashed node gets its job requeued; a premium job preempts a free one."""

from __future__ import annotations

import pytest

from tests.support.slurm import cancel, hostnames, job_fields, sbatch, wait_for, write_script
from toolkit.lab import lifecycle
from toolkit.slurm import commands


@pytest.mark.slow
def test_node_crash_requeues_the_job_elsewhere(lab, shared_tmp, heal_lab):
    # Every start of the batch script leaves a line: restart count and the nodes it got.
    # Every start of the batch script leaves a line; every task of the step a file once it runs.
    script = write_script(shared_tmp / "long.sh", (
        f'echo "${{SLURM_RESTART_COUNT:-0}} $SLURM_JOB_NODELIST" >> {shared_tmp}/starts\n'
        f'srun bash -c \'touch {shared_tmp}/running-${{SLURM_RESTART_COUNT:-0}}-$SLURMD_NODENAME; exec sleep 600\'\n'
    ))
    job_id = sbatch(script, "--nodes=2", "--requeue", "--time=15", f"--output={shared_tmp}/out-%j-%s")
    try:
        running = wait_for("the job to run", lambda: job_fields(job_id).get("JobState") == "RUNNING", timeout=60)
        assert running
        first_nodes = hostnames(job_fields(job_id)["NodeList"])
        victim = first_nodes[1]  # not the batch host: its loss is the common case
        # Crash the node only once the step runs on it: a node lost before the step starts is
        # another case (the job script's, tested in test_training.py).
        wait_for("the step to run on every node",
                 lambda: all((shared_tmp / f"running-0-{node}").exists() for node in first_nodes), timeout=60)
        killed = lifecycle.crash(victim)
        assert killed, f"nothing ran in {victim}'s namespace"

        def restarted_elsewhere():
            fields = job_fields(job_id)
            if int(fields.get("Restarts", "0")) >= 1 and fields.get("JobState") == "RUNNING":
                return fields
            return None

        fields = wait_for("the job to be requeued and run again", restarted_elsewhere, timeout=240, interval=1)
        assert victim not in hostnames(fields["NodeList"])
        restart_counts = [line.split()[0] for line in (shared_tmp / "starts").read_text().splitlines()]
        assert restart_counts == ["0", "1"]  # the batch script ran again from the top, once
        node_state = commands.run(["sinfo", "--noheader", "--Node", "--nodes", victim, "--format=%T"]).stdout
        assert "down" in node_state or "not_responding" in node_state or "*" in node_state
    finally:
        cancel(job_id)


def test_premium_job_preempts_a_free_job_by_requeue(lab, shared_tmp):
    script = write_script(shared_tmp / "sleep.sh", "srun sleep 600\n")
    everything = len(lab.nodes)
    free_job = sbatch(script, "--partition=free", f"--nodes={everything}", "--requeue",
                      f"--output={shared_tmp}/free-%j-%s")
    premium_job = None
    try:
        wait_for("the free job to fill the lab", lambda: job_fields(free_job).get("JobState") == "RUNNING",
                 timeout=60)
        premium_job = sbatch(script, "--partition=premium", "--nodes=1", f"--output={shared_tmp}/premium-%j")

        wait_for("the premium job to run", lambda: job_fields(premium_job).get("JobState") == "RUNNING",
                 timeout=90)
        free = job_fields(free_job)
        # Requeued, not killed: the free job is back in the queue with a restart counted.
        assert free["JobState"] in {"PENDING", "REQUEUED", "CONFIGURING"}
        assert int(free["Restarts"]) >= 1
        def requeue_accounted():
            states = commands.run(["sacct", "-j", free_job, "--allocations", "--duplicates", "--noheader",
                                   "--parsable2", "--format=State"]).stdout.split()
            return states if {"PREEMPTED", "REQUEUED"} & set(states) else None

        wait_for("sacct to record the preemption", requeue_accounted, timeout=60)
    finally:
        cancel(free_job, *([premium_job] if premium_job else []))
