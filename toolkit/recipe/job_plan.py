"""What a job takes from its cluster profile, decided on the login node (`ft render`) and carried in
the run spec: the site's values and the training step it starts, read typed by the job, its
launchers and ranks (environment variables carry only who a process is: its job, node and rank)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field

from toolkit.recipe.schema import Strict
from toolkit.slurm import steps


class SitePlan(Strict):
    """What the job takes from its cluster's profile: one typed value each, one default each."""
    model_config = ConfigDict(strict=True)

    cluster: str = Field("", description="The cluster profile's name (a label of the run's metrics)")
    shared_root: str = Field("", description="ft's folder on the shared filesystem: caches, registry, runs "
                                             "('' : the run directory's grandparent, <shared root>/runs/<run>)")
    distributed_backend: Literal["nccl", "gloo"] = Field("nccl", description="torch.distributed's backend: NCCL on "
                                                                            "GPUs, gloo on the profile's CPU workers")
    s3_prefix: str = Field("", description="Where checkpoints and adapters are mirrored, unless the recipe names "
                                           "its own mirror ('': nowhere)")
    s3_models: str = Field("", description="The site's models in its object store ('': none)")
    monitoring_targets: str = Field("", description="The folder where the run announces its metrics endpoint to "
                                                    "Prometheus ('': not announced)")
    receipt_signer: str = Field("", description="The site signer's socket, which seals the run's receipt "
                                                "('': the receipt stays unsigned)")

    def shared_root_of(self, run_dir: Path) -> str:
        return self.shared_root or str(run_dir.parent.parent)


class StepPlan(Strict):
    model_config = ConfigDict(strict=True)  # written by ft, read by ft: "2" for 2 is a damaged file

    python: str = Field("python3", min_length=1, description="The interpreter that runs ft on the compute nodes "
                                                             "(the profile's training environment)")
    srun_options: list[str] = Field([], description="The profile's own srun options (srun_extra_args, a "
                                                    "container image and its mounts)")
    whole_nodes: bool = Field(False, description="The job holds whole nodes (--exclusive): each node's step "
                                                 "gets every core of it, not the job's --cpus-per-task")

    def srun(self, nodes: int, node_log: str, cpus_on_node: str, cpus_per_task: str) -> list[str]:
        """The step: one ft launcher per node, with every core of the node where the job holds it
        whole, else the job's own (Slurm's SLURM_CPUS_ON_NODE and SLURM_CPUS_PER_TASK). `node_log` is
        each node's log, with srun's %N for the node (the run's layout names it)."""
        cpus = cpus_on_node if self.whole_nodes else (cpus_per_task or "1")
        return steps.training_step(nodes, cpus, node_log, self.srun_options,
                                   [self.python, "-m", "toolkit.launch"])
