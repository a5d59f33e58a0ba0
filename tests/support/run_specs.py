"""Run specs (what a job reads from recipe.json) for tests that start a launcher or a watchdog
without rendering a job script."""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.recipe.job_plan import SitePlan
from toolkit.recipe.run_spec import Derived, RunSpec
from toolkit.recipe.schema import Recipe
from toolkit.runs.layout import RunLayout


def run_spec(nodes: int = 1, watchdog: dict | None = None, env: dict | None = None,
             site: dict | None = None) -> RunSpec:
    """A spec of `nodes` CPU nodes (gloo), the cluster's values `site` (toolkit/recipe/job_plan.py's SitePlan)."""
    recipe = Recipe.model_validate({"name": "unit", "model": {"base": "tiny-llama"}, "data": {"train": "/dev/null"},
                                    "resources": {"nodes": nodes}, "training": {"global_batch": nodes},
                                    "watchdog": watchdog or {}, "env": env or {}})
    return RunSpec(recipe=recipe, derived=Derived(workers_per_node=1, world_size=nodes, gradient_accumulation=1,
                                                  out_of_memory_micro_batch=1, partition="standard"),
                   site=SitePlan.model_validate({"distributed_backend": "gloo", **(site or {})}))


def write_run_spec(run_dir: Path, spec: RunSpec) -> None:
    RunLayout(run_dir).spec.write_text(json.dumps(spec.model_dump(mode="json")))
