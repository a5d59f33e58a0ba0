"""The lab serves multi-node GPU jobs with accounting."""

from __future__ import annotations

import pytest

from tests.support.slurm import job_fields, sbatch, wait_for, write_script
from toolkit.lab.smoke import run_smoke
from toolkit.slurm import accounting

pytestmark = pytest.mark.slurm_matrix  # what ft asks of Slurm: run on every release


def test_two_node_job_runs_on_two_hosts_with_distinct_names_and_addresses(lab):
    result = run_smoke(nodes=2, gpus_per_node=1, partition=lab.tiers["standard"])

    assert result.state == "COMPLETED"
    assert [task["rank"] for task in result.tasks] == [0, 1]
    hostnames = {task["hostname"] for task in result.tasks}
    addresses = {task["address"] for task in result.tasks}
    assert len(hostnames) == 2 and len(addresses) == 2
    lab_nodes = {node.name: node.address for node in lab.nodes}
    for task in result.tasks:
        # Each task sees the node Slurm gave it as its own host: its hostname and its address.
        assert task["hostname"] == task["node"]
        assert lab_nodes[task["hostname"]] == task["address"]


def test_gpus_are_allocated_as_gres_per_node(lab, shared_tmp):
    script = write_script(shared_tmp / "gpus.sh", (
        f'srun --output={shared_tmp}/task-%t.out bash -c '
        '\'echo "$(hostname) $CUDA_VISIBLE_DEVICES $SLURM_GPUS_ON_NODE"\'\n'
    ))
    job_id = sbatch(script, "--nodes=2", "--gpus-per-node=2", f"--output={shared_tmp}/job.out")
    wait_for(f"job {job_id} to finish", lambda: job_fields(job_id).get("JobState") in {"COMPLETED", "FAILED"}
             or not job_fields(job_id), timeout=90)

    lines = sorted((shared_tmp / f"task-{rank}.out").read_text().split() for rank in (0, 1))
    assert len({line[0] for line in lines}) == 2  # one task on each of two nodes
    for _host, visible, on_node in lines:
        assert visible == "0,1"
        assert on_node == "2"
    # The controller accounts 2 GPUs on each of the 2 nodes.
    # Accounting hears of the allocation a moment after the controller: wait for its record.
    def accounted():
        return [job.gpus for job in accounting.jobs_of([job_id]) if job.gpus] or None

    assert wait_for("sacct to record the GPUs", accounted, timeout=60) == [4]


def test_sacct_json_returns_the_job(lab, shared_tmp):
    script = write_script(shared_tmp / "hello.sh", "srun hostname\n")
    job_id = sbatch(script, "--nodes=2", "--job-name=ft-sacct-json", f"--output={shared_tmp}/out")

    def finished():
        jobs = [job for job in accounting.jobs_of([job_id]) if job.job_id == job_id]
        # slurmdbd fills the record in as messages arrive: wait for the final one.
        done = jobs and jobs[-1].state == "COMPLETED" and jobs[-1].name != "allocation"
        return jobs if done else None

    jobs = wait_for(f"sacct --json to report job {job_id} completed", finished, timeout=90)
    job = jobs[-1]
    assert job.name == "ft-sacct-json" and job.user == "root"
    assert job.cluster == lab.cluster
    assert len(job.nodes) == 2 and job.elapsed_s is not None and job.start
    assert job.exit_code == 0
