"""What a job reads: the resolved recipe and every value derived from it, computed once on the login
side (`toolkit.recipe.resolve`), shown by `ft recipe explain`, carried inside the job script and
read back, typed, by the launchers, the watchdog and the ranks. Importable without torch."""

from __future__ import annotations

import os
from dataclasses import dataclass

from pydantic import ConfigDict, Field, model_validator

from toolkit.recipe.job_plan import SitePlan, StepPlan
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
    model_config = ConfigDict(strict=True)  # written by ft, read by ft: "2" for 2 is a damaged file

    workers_per_node: int = Field(ge=1, description="Training processes per node: GPUs, or the profile's CPU "
                                                    "workers")
    world_size: int = Field(ge=1, description="Ranks that train: nodes x workers per node (spare nodes excluded)")
    gradient_accumulation: int = Field(ge=1, description="Micro batches per optimizer step on each rank")
    out_of_memory_micro_batch: int = Field(ge=1, description="The micro batch of the one retry after running "
                                                             "out of memory (same global batch)")
    partition: str = Field(description="The Slurm partition of the recipe's tier")
    qos: str | None = Field(None, description="The Slurm QOS of the recipe's tier")
    job_mtbf_hours: float | None = Field(None, gt=0, description="checkpoint.every_minutes auto: the job's mean "
                                                                 "time between failures, the cluster's node MTBF "
                                                                 "over the job's nodes (spares included)")


class RunSpec(Strict):
    recipe: Recipe
    derived: Derived
    site: SitePlan = SitePlan()
    step: StepPlan = StepPlan()

    @model_validator(mode="before")
    @classmethod
    def site_of_an_older_script(cls, data: object) -> object:
        """A spec rendered by ft before it carried the site (a job requeued across an upgrade of ft
        reruns the script it was submitted with): its values from the variables that script
        exported, as they were read then."""
        if isinstance(data, dict) and "site" not in data and "recipe" in data and "FT_RUN_DIR" in os.environ:
            legacy = {"cluster": "FT_CLUSTER", "shared_root": "FT_SHARED_ROOT",
                      "distributed_backend": "FT_DIST_BACKEND", "s3_prefix": "FT_S3_PREFIX",
                      "s3_models": "FT_S3_MODELS", "monitoring_targets": "FT_MONITORING_TARGETS",
                      "receipt_signer": "FT_RECEIPT_SIGNER"}
            data = {**data, "site": {field: os.environ[name] for field, name in legacy.items() if name in os.environ}}
        return data

    @model_validator(mode="before")
    @classmethod
    def engine_of_an_older_script(cls, data: object) -> object:
        """A spec rendered before data.packing and training.compile existed trains as it was planned:
        unpacked (packing changes the steps an epoch has, so a resumed run would end early or late)
        and eager. ft's resolver writes both as true or false since (resolve.py)."""
        if not (isinstance(data, dict) and isinstance(data.get("recipe"), dict)):
            return data
        recipe = data["recipe"]
        pinned = {}
        for section, name in (("data", "packing"), ("training", "compile")):
            if isinstance(recipe.get(section), dict) and name not in recipe[section]:
                pinned[section] = {**recipe[section], **pinned.get(section, {}), name: False}
        return {**data, "recipe": {**recipe, **pinned}} if pinned else data

    @model_validator(mode="after")
    def derived_from_the_recipe(self) -> RunSpec:
        """A spec edited by hand (in the job script) must still add up: the job would otherwise
        train on another batch than the recipe's, or on no rank at all."""
        training, derived = self.recipe.training, self.derived
        if training.global_batch is None:
            raise ValueError("recipe.training.global_batch is unset: the recipe was not resolved (ft render does)")
        if derived.world_size != self.recipe.resources.nodes * derived.workers_per_node:
            raise ValueError(f"derived.world_size {derived.world_size} is not resources.nodes x workers_per_node "
                             f"({self.recipe.resources.nodes} x {derived.workers_per_node})")
        if training.global_batch % (training.micro_batch * derived.world_size):
            raise ValueError(f"training.global_batch {training.global_batch} is not a multiple of micro_batch x "
                             f"world_size ({training.micro_batch} x {derived.world_size})")
        expected = batch_plan(training, derived.world_size)
        if derived.gradient_accumulation != expected.gradient_accumulation:
            raise ValueError(f"derived.gradient_accumulation {derived.gradient_accumulation} should be "
                             f"{expected.gradient_accumulation} for this batch and world size")
        if derived.out_of_memory_micro_batch != batch_plan(training, derived.world_size, True).micro_batch:
            raise ValueError("derived.out_of_memory_micro_batch does not follow from the batch and world size")
        return self
