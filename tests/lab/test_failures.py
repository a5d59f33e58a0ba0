"""Failure is normal, as Slurm itself handles it: a crashed node gets its job requeued (preemption of
an ft run, and what ft adds to node loss, are in tests/lab/test_recovery.py)."""

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
