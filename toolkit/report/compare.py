"""Runs side by side (`ft compare`): the recipe fields in which they differ, and what each did.

A researcher compares the points of a sweep, or a run against the one it was forked from: the
fields that vary are found by flattening each run's resolved recipe (its run spec) and keeping the
dotted names whose values are not all alike; the rest of a row is what the run's own files say
(metrics, summary, evaluation, timeline). Nothing here asks Slurm: the states come with the runs'
statuses, which the caller reads.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from toolkit.recipe.resolve import dotted_values
from toolkit.report.page import by_start, metrics_entries
from toolkit.runs.layout import RunLayout, RunSpecError
from toolkit.runs.progress import number
from toolkit.runs.status import RunStatus

# Fields of every recipe that say where and as whom a run ran, not what it tried: never "varied".
NOT_VARIED = ("name",)


@dataclass(frozen=True)
class ComparedRun:
    run_id: str
    cluster: str
    state: str
    varied: dict[str, object]  # each varied field's value in this run ("-" where its spec is unreadable)
    steps: int | None = None
    final_loss: float | None = None
    best_loss: float | None = None
    tokens_per_s: float | None = None  # training throughput over its starts (their step lines)
    eval_loss: dict[str, float] = field(default_factory=dict)  # each evaluated split's loss after training
    verdict: str | None = None  # the evaluation gates' state (passed, failed, ...)
    gpu_hours: float | None = None
    goodput: float | None = None


@dataclass(frozen=True)
class Comparison:
    varied: list[str]  # the dotted recipe fields whose values differ between the runs
    runs: list[ComparedRun]

    def to_dict(self) -> dict:
        return {"varied": self.varied, "runs": [asdict(run) for run in self.runs]}


def recipe_fields(current: RunStatus) -> dict[str, object] | None:
    try:
        spec = RunLayout(current.run_dir).read_spec()
    except RunSpecError:  # a damaged or foreign spec: the run is still compared on what it did
        return None
    return dotted_values(spec.recipe)


def varied_fields(recipes: list[dict[str, object] | None]) -> list[str]:
    """The fields whose values are not alike in every readable recipe (missing counts as a value)."""
    readable = [recipe for recipe in recipes if recipe is not None]
    names = sorted({name for recipe in readable for name in recipe})
    missing = object()
    return [name for name in names if name not in NOT_VARIED
            and len({repr(recipe.get(name, missing)) for recipe in readable}) > 1]


def training_lines(current: RunStatus) -> tuple[float | None, float | None]:
    """The best loss of the run's step lines, and its tokens per second over its starts."""
    best, tokens, seconds = math.inf, 0.0, 0.0
    starts = by_start(list(metrics_entries(RunLayout(current.run_dir).metrics)))
    for start in starts:
        for line in start:
            loss = number(line.get("loss"))
            if loss is not None:
                best = min(best, loss)
        first, last = start[0], start[-1]
        made = (number(last.get("tokens")) or 0) - (number(first.get("tokens")) or 0)
        if last["time"] > first["time"] and made > 0:
            tokens, seconds = tokens + made, seconds + last["time"] - first["time"]
    return (best if math.isfinite(best) else None), (tokens / seconds if seconds else None)


def evaluation(current: RunStatus) -> tuple[dict[str, float], str | None]:
    results = current.evaluation or {}
    trained = results.get("adapter")
    losses = {}
    if isinstance(trained, dict):
        for split, found in trained.items():
            loss = number(found.get("loss")) if isinstance(found, dict) else None
            if loss is not None:
                losses[split] = loss
    state = results.get("state")
    return losses, state if isinstance(state, str) else None


def compare(statuses: list[RunStatus]) -> Comparison:
    recipes = [recipe_fields(current) for current in statuses]
    varied = varied_fields(recipes)
    runs = []
    for current, recipe in zip(statuses, recipes, strict=True):
        summary, spent = current.summary or {}, current.timeline or {}
        best, speed = training_lines(current)
        losses, verdict = evaluation(current)
        steps = summary.get("steps")
        runs.append(ComparedRun(
            run_id=current.run.run_id, cluster=current.run.cluster, state=current.state,
            varied={name: recipe.get(name) if recipe is not None else "-" for name in varied},
            steps=steps if type(steps) is int else None, final_loss=number(summary.get("final_loss")),
            best_loss=best, tokens_per_s=speed, eval_loss=losses, verdict=verdict,
            gpu_hours=number(summary.get("gpu_hours")), goodput=number(spent.get("goodput"))))
    return Comparison(varied, runs)
