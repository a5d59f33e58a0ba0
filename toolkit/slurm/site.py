"""The scheduler's part of a cluster profile (toolkit/cluster/profile.py): the nodes, the tiers a
recipe names (a partition and QOS each), the accounts and their quotas. What renders #SBATCH lines,
the broker and the quotas read."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from toolkit.base.names import slurm_name


class TierTarget(BaseModel):
    model_config = ConfigDict(extra="forbid")
    partition: str
    qos: str | None = None
    # The tier's own price per GPU-hour (a free tier's is lower, a premium one's higher); None: the profile's.
    price_per_gpu_hour: float | None = Field(None, ge=0, allow_inf_nan=False)

    _names = field_validator("partition", "qos")(slurm_name)


class AccountQuota(BaseModel):
    """An account's share of the cluster (the inventory's slurm_accounting_accounts, through ft_profile)."""
    model_config = ConfigDict(extra="forbid")
    # A month's GPU-hours: past the budget ft warns and flags the overage; past the cap ft refuses and
    # Slurm holds the jobs.
    budget_gpu_hours: float | None = Field(None, ge=0, allow_inf_nan=False)
    cap_gpu_hours: float | None = Field(None, ge=0, allow_inf_nan=False)
    max_running_jobs: int | None = Field(None, ge=0)  # runs at once; more wait in the queue


class SchedulerSite(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gpus_per_node: int = Field(ge=0)
    # Workers per node where there are no GPUs (the lab: gloo on CPU). None: one per GPU.
    cpu_workers_per_node: int | None = None
    max_nodes: int | None = Field(None, ge=1)
    # The GPU nodes' size, for what a job asks of them: its share of their cores and memory (a job on
    # 2 of 8 GPUs asks for a quarter). None: not known (`ft cluster add` reads them from sinfo).
    cpus_per_node: int | None = Field(None, ge=1)
    memory_per_node_mb: int | None = Field(None, ge=1)
    # One GPU's memory, for the memory plan (toolkit/recipe/memory_plan.py): the resolver chooses
    # activation checkpointing and the ZeRO stage from it. None: not known (size rules instead).
    gpu_memory_gib: float | None = Field(None, gt=0, allow_inf_nan=False)
    # The site gives GPU nodes whole (HyperPod, SUNK, most GPU clouds): jobs ask --exclusive and all
    # of each node's memory.
    exclusive_nodes: bool = False
    tiers: dict[str, TierTarget]
    default_account: str | None = None
    accounts: dict[str, AccountQuota] = {}

    _account = field_validator("default_account")(slurm_name)

    @field_validator("tiers")
    @classmethod
    def has_standard_tier(cls, value: dict[str, TierTarget]) -> dict[str, TierTarget]:
        if "standard" not in value:
            raise ValueError("a profile needs at least the standard tier (tiers.standard.partition)")
        return value

    @property
    def standard_tier(self) -> TierTarget:
        """Where ft's own short jobs (the environment build, doctor's preflight) run."""
        return self.tiers["standard"]

    @property
    def distributed_backend(self) -> str:
        return "gloo" if self.cpu_workers_per_node else "nccl"
