"""The prices part of a cluster profile (toolkit/cluster/profile.py): what a GPU-hour costs (a
tier may set its own: toolkit/slurm/site.py), for `ft usage`, the broker and budgets."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PriceSite(BaseModel):
    model_config = ConfigDict(extra="forbid")

    price_per_gpu_hour: float = Field(0.0, ge=0, allow_inf_nan=False)
