"""The training step a job starts, decided on the login node (`ft render`) from the cluster profile
and carried in the run spec: the job reads it typed instead of from the environment."""

from __future__ import annotations

from pydantic import ConfigDict, Field

from toolkit.recipe.schema import Strict
from toolkit.slurm import steps


class StepPlan(Strict):
    model_config = ConfigDict(strict=True)  # written by ft, read by ft: "2" for 2 is a damaged file

    python: str = Field("python3", min_length=1, description="The interpreter that runs ft on the compute nodes "
                                                             "(the profile's training environment)")
    srun_options: list[str] = Field([], description="The profile's own srun options (srun_extra_args, a "
                                                    "container image and its mounts)")
    whole_nodes: bool = Field(False, description="The job holds whole nodes (--exclusive): each node's step "
                                                 "gets every core of it, not the job's --cpus-per-task")

    def srun(self, nodes: int, logs: str, cpus_on_node: str, cpus_per_task: str) -> list[str]:
        """The step: one ft launcher per node, with every core of the node where the job holds it
        whole, else the job's own (Slurm's SLURM_CPUS_ON_NODE and SLURM_CPUS_PER_TASK)."""
        cpus = cpus_on_node if self.whole_nodes else (cpus_per_task or "1")
        return steps.training_step(nodes, cpus, f"{logs}/node-%N.log", self.srun_options,
                                   [self.python, "-m", "toolkit.launch"])
