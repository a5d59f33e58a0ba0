"""The lab's nodes confine jobs as real ones do (cgroup/v1: cores, memory, GPUs; see the lab
inventory), and ft's launcher gives each rank its share of the cores its step holds."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.slurm import job_fields, sbatch, wait_for, write_script
from tests.support.training import ft, lab_runs, submit, tiny_recipe, wait_done
from toolkit.train import cores

pytestmark = pytest.mark.slurm_matrix  # task/cgroup and task/affinity of each release

PROBE = r"""
import errno, json, os, sys
def opened(path):
    try:
        open(path).close()
        return "opened"
    except OSError as exc:
        return errno.errorcode[exc.errno]
cpus = sorted(os.sched_getaffinity(0))
try:
    os.sched_setaffinity(0, range(os.cpu_count()))
    widened = sorted(os.sched_getaffinity(0)) != cpus
except OSError:
    widened = False
# Slurm sets the limit on the job's and the step's cgroups, above the task's: the tightest holds.
memory = "/sys/fs/cgroup/memory" + open("/proc/self/cgroup").read().split("memory:")[1].split()[0]
limit = min(int(open(os.path.join(memory, *[".."] * up, "memory.limit_in_bytes")).read()) for up in range(4))
gpus = [name for name in sorted(os.listdir(sys.argv[1])) if name.startswith("nvidia")]
print(json.dumps({"cpus": cpus, "widened": widened, "limit_mb": limit >> 20,
                  "gpus": {name: opened(os.path.join(sys.argv[1], name)) for name in gpus}}))
"""


def two_rank_recipe(folder: Path, name: str, cluster: str) -> Path:
    """The tiny recipe, short, on one node with two GPUs' worth of ranks, on `cluster`."""
    recipe = tiny_recipe()
    recipe.update({"name": name, "cluster": cluster})
    recipe["resources"].update({"nodes": 1, "gpus_per_node": 2})
    recipe["training"]["steps"] = 4
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_a_step_is_held_to_its_cores_memory_and_gpus(lab, shared_tmp):
    probe = shared_tmp / "probe.py"
    probe.write_text(PROBE)
    script = write_script(shared_tmp / "confined.sh", (
        f'srun {sys.executable} {probe} "/var/lib/ft-lab/dev/$SLURMD_NODENAME" > {shared_tmp}/probe.json\n'))
    job_id = sbatch(script, "--nodes=1", "--cpus-per-task=1", "--mem=300M", "--gpus-per-node=1",
                    f"--output={shared_tmp}/job.out")
    wait_for(f"job {job_id} to finish", lambda: job_fields(job_id).get("JobState") in {"COMPLETED", "FAILED"}
             or not job_fields(job_id), timeout=90)
    seen = json.loads((shared_tmp / "probe.json").read_text())

    assert len(seen["cpus"]) == 1 and not seen["widened"]  # one core, and no way out of it
    assert seen["limit_mb"] == 300
    # The one GPU given is the only one the step may open (no driver here: ENXIO), the rest are denied.
    assert len(seen["gpus"]) == lab.gpus_per_node
    assert sorted(seen["gpus"].values()) == ["ENXIO", *["EPERM"] * (lab.gpus_per_node - 1)]


def test_each_rank_keeps_to_its_share_of_the_steps_cores(lab, shared_tmp):
    # Two ranks on one node (a profile of the lab's with two CPU workers per node, as a GPU node runs
    # one per GPU): the job asks for 3 of a lab node's 4 CPUs (toolkit/render/node_request.py), which
    # Slurm holds as the machine's 2 cores: a core each.
    clusters = shared_tmp / "clusters.yaml"
    clusters.write_text(yaml.safe_dump({"lab-two-ranks": {"extends": "lab", "cpu_workers_per_node": 2}}))
    path = two_rank_recipe(shared_tmp, "tiny-cores", "lab-two-ranks")
    runs = lab_runs(lab, "confinement")
    submitted = submit(path, runs_dir=runs, env={"FT_CLUSTERS_FILE": str(clusters)})
    assert wait_done(submitted["run_id"], runs_dir=runs) == "COMPLETED"
    run_dir = Path(submitted["run_dir"])

    [launcher_log] = (run_dir / "logs").glob("node-*.log")  # one node: one launcher
    logs = launcher_log.read_text()
    step, plan = re.search(r"cores: the step holds (\S+); (.*)", logs).groups()
    step_cores = cores.parse_cpu_list(step)
    planned = dict(re.findall(r"rank (\d+): ([\d,-]+)", plan))
    assert set(planned) == {"0", "1"}
    each = [cores.parse_cpu_list(planned[rank]) for rank in ("0", "1")]
    assert len(step_cores) == 2 and each[0] and not set(each[0]) & set(each[1])
    assert sorted(each[0] + each[1]) == step_cores
    for rank, mine in enumerate(each):
        # What the rank holds once it pinned itself, with its thread pool sized to it.
        said = (run_dir / "logs" / f"rank-{rank}.log").read_text()
        assert f"[rank {rank}] cores {cores.format_cpu_list(mine)}, " in said


def test_a_job_asking_too_few_cores_is_told_so_before_and_as_it_runs(lab, shared_tmp):
    clusters = shared_tmp / "clusters.yaml"
    clusters.write_text(yaml.safe_dump({
        "lab-two-ranks": {"extends": "lab", "cpu_workers_per_node": 2},
        # A profile that does not know its nodes' cores: jobs ask a core per rank and one more.
        "lab-unsized": {"extends": "lab", "cpu_workers_per_node": 2, "cpus_per_node": None}}))
    env = {"FT_CLUSTERS_FILE": str(clusters)}
    path = two_rank_recipe(shared_tmp, "tiny-few-cores", "lab-unsized")

    explained = ft("recipe", "explain", str(path), runs_dir=shared_tmp, env=env)
    assert explained.returncode == 0, explained.stderr
    assert "does not give its nodes' cores (cpus_per_node)" in " ".join(explained.stdout.split())
    doctor = ft("doctor", "--cluster", "lab-unsized", "--login-only", "--json", runs_dir=shared_tmp, env=env)
    [node_size] = [found for found in json.loads(doctor.stdout)["findings"] if found["check"] == "node_size"]
    assert node_size["level"] == "warn" and "cpus_per_node" in node_size["detail"]
    assert node_size["fix"].startswith("ft cluster set lab-unsized cpus_per_node=4")

    # A power user's edit: the rendered script asks one core for its two ranks. Slurm holds the step
    # to it, and the launcher says so in the run's log as it starts.
    path = two_rank_recipe(shared_tmp, "tiny-few-cores", "lab-two-ranks")
    script = shared_tmp / "job.sbatch"
    rendered = ft("render", str(path), "--run-id", "tiny-few-cores-by-hand", "-o", str(script), runs_dir=shared_tmp,
                  env=env)
    assert rendered.returncode == 0, rendered.stderr
    text = script.read_text()
    assert "#SBATCH --cpus-per-task=3\n" in text
    script.write_text(text.replace("#SBATCH --cpus-per-task=3\n", "#SBATCH --cpus-per-task=1\n"))
    job_id = sbatch(script)
    wait_for(f"job {job_id} to finish", lambda: job_fields(job_id).get("JobState") in {"COMPLETED", "FAILED"}
             or not job_fields(job_id), timeout=300, interval=2)
    run_dir = shared_tmp / "tiny-few-cores-by-hand"
    [launcher_log] = (run_dir / "logs").glob("node-*.log")
    said = " ".join(launcher_log.read_text().split())
    assert "holds 1 CPU(s)" in said and "for 2 ranks: they share them" in said and "at least 3" in said
