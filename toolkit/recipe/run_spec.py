"""What a job reads: the resolved recipe and every value derived from it, computed once on the login
side (`toolkit.recipe.resolve`), shown by `ft recipe explain`, carried inside the job script and
read back, typed, by the launchers, the watchdog and the ranks. Importable without torch."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import Field

from toolkit.recipe.schema import Recipe, Strict, TrainingSpec


@dataclass(frozen=True)
class BatchPlan:
    micro_batch: int
    gradient_accumulation: int


def batch_plan(training: TrainingSpec, world_size: int, out_of_memory_retry: bool = False) -> BatchPlan:
    """The micro batch and the accumulation that make the global batch on `world_size` ranks. On the
    job's one retry after running out of memory: the largest micro batch at most half the recipe's
    that still divides each rank's share, so the global batch stays the same (halving an odd micro
    batch would break DeepSpeed's batch arithmetic). The one rule, for both sides."""
    per_rank = training.global_batch // world_size
    micro = training.micro_batch
    if out_of_memory_retry:
        micro = max(m for m in range(1, max(1, micro // 2) + 1) if per_rank % m == 0)
    return BatchPlan(micro, per_rank // micro)


class Derived(Strict):
    workers_per_node: int = Field(description="Training processes per node: GPUs, or the profile's CPU workers")
    world_size: int = Field(description="Ranks that train: nodes x workers per node (spare nodes excluded)")
    gradient_accumulation: int = Field(description="Micro batches per optimizer step on each rank")
    out_of_memory_micro_batch: int = Field(description="The micro batch of the one retry after running out "
                                                       "of memory (same global batch)")
    partition: str = Field(description="The Slurm partition of the recipe's tier")
    qos: str | None = Field(None, description="The Slurm QOS of the recipe's tier")


class RunSpec(Strict):
    recipe: Recipe
    derived: Derived
