"""Steps ft starts: srun's options, spelled in one place."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ShortStep:
    """A short step of its own allocation (`srun` from a login node), placed as a profile's jobs are:
    with their GPUs (where Slurm constrains devices, a step without GPUs sees none)."""
    nodes: int
    partition: str
    job_name: str
    wait_s: int  # how long it may wait for nodes (--immediate): never queued for long
    minutes: int = 5
    qos: str | None = None
    account: str | None = None
    gpus_per_node: int = 0
    container_image: str | None = None  # pyxis/enroot: the step runs in this image
    container_mounts: str | None = None

    def argv(self, *command: str) -> list[str]:
        argv = ["srun", f"--nodes={self.nodes}", "--ntasks-per-node=1", f"--partition={self.partition}",
                f"--time={self.minutes}", f"--job-name={self.job_name}", f"--immediate={self.wait_s}",
                "--chdir=/", "--quiet",
                "--label"]  # whole lines per task: two nodes' long lines would otherwise interleave
        if self.qos:
            argv.append(f"--qos={self.qos}")
        if self.account:
            argv.append(f"--account={self.account}")
        if self.gpus_per_node:
            argv.append(f"--gres=gpu:{self.gpus_per_node}")
        if self.container_image:
            argv += [f"--container-image={self.container_image}", "--container-workdir=/",
                     *([f"--container-mounts={self.container_mounts}"] if self.container_mounts else [])]
        return [*argv, *command]


def training_step(nodes: int, cpus_per_task: str, output: str, options: list[str], command: list[str]) -> list[str]:
    """A job's training step: one task (the node's launcher) on each of `nodes` nodes, told its
    cores (whether srun inherits the job's --cpus-per-task changed in 22.05 and again in 23.11);
    --kill-on-bad-exit: one failed node stops them all at once."""
    return ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            f"--cpus-per-task={cpus_per_task}", f"--output={output}", *options, *command]


# The options that shape a step (where it runs, how many tasks, its output): what a step made from
# another step's srun command line sets anew.
STEP_SHAPE = ("--nodes=", "--ntasks=", "--ntasks-per-node=", "--kill-on-bad-exit", "--output=", "--nodelist=",
              "--open-mode=")


def on_nodes(command: list[str], nodes: list[str]) -> list[str]:
    """An srun command line placed on these nodes of the allocation. --overlap: a step that spanned
    a lost node lingers until Slurm declares the node DOWN, and holds its share of the survivors
    meanwhile (measured on Slurm 22.05); and from 20.11 on a step gets no share of a node's CPUs that
    another step holds unless it overlaps."""
    return [command[0], f"--nodelist={','.join(nodes)}", "--overlap", *command[1:]]


def one_task_beside(command: list[str], node: str, output: str, program: list[str]) -> list[str]:
    """A one-task step on `node` that shares it with the training steps (--overlap), with the same
    options as `command` (a container, GPUs, the site's extras) but its shape, running `program`,
    its output appended to `output`."""
    options = [option for option in command[1:] if not option.startswith(STEP_SHAPE)]
    return [command[0], f"--nodelist={node}", "--nodes=1", "--ntasks=1", "--overlap", f"--output={output}",
            "--open-mode=append", *options, *program]


def successor_step(job_id: str, node: str, program: list[str]) -> list[str]:
    """The step that takes the place of a lost batch host's job script (toolkit/job/successor.py):
    one task on `node`, sharing it (--overlap), started from another step of the job. It lasts as
    long as its srun client (Slurm ends a step whose client goes away on a live node), which the
    starting launcher keeps. No stdin, and no output through srun (slurmstepd loses a step's last
    lines when the step ends: the program writes the job's batch log itself). --cpu-bind=none: srun
    would take the starting step's CPU mask from its environment (SLURM_CPU_BIND), which the new
    step's CPUs need not satisfy (refused on the lab)."""
    return ["srun", f"--jobid={job_id}", f"--nodelist={node}", "--nodes=1", "--ntasks=1", "--cpus-per-task=1",
            "--overlap", "--cpu-bind=none", "--input=none", "--output=/dev/null", "--error=/dev/null", *program]
