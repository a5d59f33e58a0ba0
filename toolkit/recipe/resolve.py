"""Load a recipe, fill its defaults from the model size, method and cluster, and check it against
the cluster. Every value carries its source, for `ft recipe explain`."""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from toolkit.base.errors import FtError
from toolkit.base.yaml_source import SourceMap, load_yaml
from toolkit.checkpoint.cadence import AutoCadence, CadenceSite
from toolkit.checkpoint.remote import mirror_url
from toolkit.cluster.profile import ClusterProfile, load_profile
from toolkit.recipe import memory_plan
from toolkit.recipe.run_spec import Derived, RunSpec, batch_plan
from toolkit.recipe.schema import DATA_FILES, Method, Objective, Recipe
from toolkit.slurm.site import SchedulerSite

TINY_MODEL = "tiny-llama"
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


class RecipeError(FtError):
    """One or more problems in a recipe, each located (file:line field) with a fix."""

    exit_code = 2

    def __init__(self, problems: list[str]):
        self.problems = problems
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        super().__init__(f"recipe has {count}:\n" + "\n".join(f"  {p}" for p in problems))


@dataclass
class ResolvedRecipe:
    recipe: Recipe
    profile: ClusterProfile
    path: Path
    derived: Derived
    sources: dict[str, str] = field(default_factory=dict)  # dotted field -> where its value came from
    memory: tuple[memory_plan.MemoryPlan, int] | None = None  # the plan of one rank, and its memory

    @property
    def spec(self) -> RunSpec:
        """What the job reads (recipe.json)."""
        return RunSpec(recipe=self.recipe, derived=self.derived)

    def values(self) -> dict[str, Any]:
        """Dotted field -> value, for every leaf of the resolved recipe."""
        return dotted_values(self.recipe)

    def with_tier(self, tier: str) -> ResolvedRecipe:
        """The same run in another of the profile's tiers (the broker's choice): its partition and QOS."""
        target = self.profile.tiers[tier]
        resources = self.recipe.resources.model_copy(update={"tier": tier})
        return replace(self, recipe=self.recipe.model_copy(update={"resources": resources}),
                       derived=self.derived.model_copy(update={"partition": target.partition, "qos": target.qos}),
                       sources=self.sources | {"resources.tier": "ft plan's choice (--cluster auto)"})


def dotted_values(recipe: Recipe) -> dict[str, Any]:
    """Dotted field -> value, for every leaf of a recipe (`env` one value, a list one value)."""
    return dict(_flatten(recipe.model_dump(mode="json")))


def _flatten(data: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(data, dict) and data and prefix.count(".") < 3 and not prefix.endswith("env"):
        items: list[tuple[str, Any]] = []
        for key, value in data.items():
            items.extend(_flatten(value, f"{prefix}.{key}" if prefix else key))
        return items
    return [(prefix, data)]


def _field_names(model: type[BaseModel], location: tuple) -> list[str]:
    """The valid keys at a location of the schema (for 'did you mean')."""
    current: Any = model
    for part in location:
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return []
        annotation = fields[part].annotation
        current = next((a for a in getattr(annotation, "__args__", (annotation,)) if hasattr(a, "model_fields")),
                       annotation)
    return list(getattr(current, "model_fields", {}))


def _describe(error: dict, source: SourceMap) -> str:
    location = tuple(error["loc"])
    dotted = ".".join(str(part) for part in location) or "(top level)"
    line = source.line_of(location)
    where = f"{source.path}:{line}" if line else source.path
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        valid = _field_names(Recipe, location[:-1])
        close = difflib.get_close_matches(str(location[-1]), valid, n=1, cutoff=0.6)
        fix = f"did you mean '{close[0]}'?" if close else f"valid keys here: {', '.join(valid)}"
        return f"{where}: {dotted}: unknown field; {fix}"
    if error["type"] == "missing":
        return f"{where}: {dotted}: required field is missing"
    if error["type"] == "enum":
        return f"{where}: {dotted}: {message} (got {error.get('input')!r})"
    return f"{where}: {dotted}: {message}"


def load_recipe(path: Path) -> tuple[Recipe, SourceMap]:
    data, source = load_yaml(path)
    if not isinstance(data, dict):
        raise RecipeError([f"{path}:1: a recipe is a YAML mapping (name:, model:, data:, ...)"])
    try:
        return Recipe.model_validate(data), source
    except ValidationError as exc:
        problems = sorted((source.line_of(tuple(e["loc"])) or 0, _describe(e, source)) for e in exc.errors())
        raise RecipeError([text for _, text in problems]) from None


def model_size_b(recipe: Recipe) -> float | None:
    """Billions of parameters: as given, or as the model's name says (Llama-3.1-8B, 70b)."""
    if recipe.model.params_b:
        return recipe.model.params_b
    if recipe.model.base == TINY_MODEL:
        return 0.002
    # A size is a part of the name of its own (Llama-3.1-8B, qwen2.5-7b-instruct, llama-70b): never digits
    # and a "b" inside a longer token (a revision's or a test's hex, "tiny-5b15a4c7").
    match = re.search(r"(?:^|[-_./ ])(\d+(?:\.\d+)?)[bB](?=$|[-_. ])", Path(recipe.model.base).name)
    return float(match[1]) if match else None


def lora_rank_for(size_b: float | None) -> int:
    if size_b is None or size_b <= 13:
        return 16 if size_b and size_b >= 3 else 8
    return 32 if size_b <= 34 else 64


class _Resolver:
    def __init__(self, recipe: Recipe, source: SourceMap, profile: ClusterProfile, cluster_from: str):
        self.recipe, self.source, self.profile = recipe, source, profile
        self.sources: dict[str, str] = {}
        self.problems: list[str] = []
        self.memory: tuple[memory_plan.MemoryPlan, int] | None = None
        self.cluster_from = cluster_from

    def given(self, dotted: str) -> bool:
        return self.source.line_of(tuple(dotted.split("."))) is not None and \
            tuple(dotted.split(".")) in self.source.lines

    def default(self, dotted: str, value: Any, why: str) -> None:
        section, name = dotted.split(".")
        if getattr(getattr(self.recipe, section), name) is None:
            setattr(getattr(self.recipe, section), name, value)
            self.sources[dotted] = f"default: {why}"

    def problem(self, dotted: str, message: str) -> None:
        line = self.source.line_of(tuple(dotted.split(".")))
        where = f"{self.source.path}:{line}" if line else self.source.path
        self.problems.append(f"{where}: {dotted}: {message}")

    def run(self) -> dict[str, str]:
        r, p = self.recipe, self.profile
        size = model_size_b(r)
        method = r.method.kind
        self.default("resources.gpus_per_node", p.gpus_per_node, f"all {p.gpus_per_node} GPUs of a {p.name} node")
        self.default("resources.account", p.default_account, f"the {p.name} profile's account")
        if method in (Method.lora.value, Method.qlora.value):
            self.default("method.rank", lora_rank_for(size), f"LoRA rank for a {size or 'unknown-size'}B model")
            self.default("method.alpha", float(2 * r.method.rank), "twice the rank")
            self.default("method.target_modules", LLAMA_TARGETS, "the attention projections of Llama-style models")
            self.default("training.learning_rate", 2e-4, f"{method} fine-tuning")
        else:
            self.default("training.learning_rate", 2e-5, "full fine-tuning")
        if r.objective.kind == Objective.dpo.value:
            if r.objective.beta is None:
                r.objective.beta = 0.1
                self.sources["objective.beta"] = "default: DPO's usual temperature"
            if r.training.learning_rate and "training.learning_rate" in self.sources:
                r.training.learning_rate /= 4
                self.sources["training.learning_rate"] += ", divided by 4 for DPO"
        self.default("training.precision", "fp32" if p.cpu_workers_per_node else "bf16",
                     "CPU workers compute in fp32" if p.cpu_workers_per_node else "bf16 on GPUs")
        self.default("data.packing", r.packed,
                     "on for SFT (global_batch and steps then count packed rows of up to max_seq_len tokens)"
                     if r.objective.kind == Objective.sft.value else "off for DPO (pairs are not packed)")
        if r.training.steps is None and r.training.epochs is None:
            r.training.epochs = 1.0
            self.sources["training.epochs"] = "default: one pass over the data"
        if r.checkpoint.s3_mirror is None:
            where = mirror_url(None, p.s3_prefix, "<run id>")
            self.sources["checkpoint.s3_mirror"] = (f"default: {where} (the cluster's s3_prefix, one per run)" if where
                                                    else "default: no mirror (the cluster has no s3_prefix)")
        self.check_resources()
        world = r.resources.nodes * workers_per_node(r, p)
        self.default("training.global_batch", r.training.micro_batch * world, "one micro batch per rank")
        self.plan_memory(size, world)
        on_gpus = not p.cpu_workers_per_node
        self.default("training.compile", r.training.compiled(on_gpus),
                     "regional torch.compile on GPUs (benchmarks/GPU.md), not under ZeRO-3" if on_gpus
                     else "off on CPU workers (compile time, little gain)")
        if r.training.global_batch % (r.training.micro_batch * world):
            self.problem("training.global_batch",
                         f"{r.training.global_batch} is not divisible by micro_batch x ranks = "
                         f"{r.training.micro_batch} x {world}; use a multiple of {r.training.micro_batch * world}")
        if r.objective.kind == Objective.dpo.value and method == Method.full.value:
            self.problem("objective.kind", "dpo uses the base model without adapters as its reference: "
                                           "train it with method lora or qlora")
        if method == Method.qlora.value and p.cpu_workers_per_node and r.resources.nodes > 1:
            self.problem("method.kind", "qlora runs on one node on CPU clusters; set resources.nodes: 1")
        return self.sources

    def plan_memory(self, size: float | None, world: int) -> None:
        """The ZeRO stage and activation checkpointing, where the recipe leaves them open: the fastest
        choice whose memory plan fits a rank (memory_plan.py); a recipe no choice fits is refused,
        naming what would. Without the model's shape or the rank's memory: rules by size."""
        r, p = self.recipe, self.profile
        budget = rank_budget(p, workers_per_node(r, p))
        shape = memory_plan.shape_of(r.model.base, size if (size or 0) >= 0.5 else None)
        if budget is None or shape is None:
            self.size_rules(size, "the model's shape is not known (no config.json, no size in its name)"
                            if budget is not None else f"the {p.name} profile gives no gpu_memory_gib")
            return
        plans = [(stage, checkpointing, memory_plan.estimate(shape, self.setup(stage, checkpointing, world)))
                 for stage, checkpointing in self.choices()]
        fitting = [choice for choice in plans if choice[2].total <= budget]
        stage, checkpointing, plan = fitting[0] if fitting else min(plans, key=lambda choice: choice[2].total)
        why = f"the memory plan: {memory_plan.gib(plan.total)} a rank of {memory_plan.gib(budget)}"
        self.default("training.zero_stage", stage, why)
        self.default("training.gradient_checkpointing", checkpointing, why)
        self.memory = (plan, budget)
        if not fitting:
            self.problem("training.micro_batch",
                         f"the memory plan needs {memory_plan.gib(plan.total)} a rank "
                         f"({', '.join(f'{n} {memory_plan.gib(v)}' for n, v in plan.parts() if v)}), more than "
                         f"the {memory_plan.gib(budget)} a rank has. "
                         + self.what_would_fit(shape, stage, checkpointing, world, budget))

    def what_would_fit(self, shape, stage: int, checkpointing: bool, world: int, budget: int) -> str:
        """The changes to the recipe whose plans fit, each tried alone from the smallest plan."""
        r = self.recipe
        base = self.setup(stage, checkpointing, world)
        tries = []
        if r.training.micro_batch > 1:
            tries.append((f"training.micro_batch: {max(1, r.training.micro_batch // 2)}",
                          replace(base, micro_batch=max(1, r.training.micro_batch // 2))))
        if r.data.max_seq_len > 512:
            shorter = r.data.max_seq_len // 2
            tries.append((f"data.max_seq_len: {shorter}", replace(base, seq_len=shorter)))
        tries.append((f"resources.nodes: {r.resources.nodes * 2}", replace(base, ranks=world * 2)))
        if stage != 3 and not r.training.compile and r.method.kind != Method.qlora.value:
            tries.append(("training.zero_stage: 3", replace(base, zero_stage=3, ft_loss=False)))
        if r.method.kind == Method.lora.value:
            tries.append(("method.kind: qlora", replace(base, method="qlora")))
        if not checkpointing and r.training.gradient_checkpointing is False:
            tries.append(("training.gradient_checkpointing: true", replace(base, checkpointing=True)))
        totals = [(change, memory_plan.estimate(shape, setup).total) for change, setup in tries]
        fits = [f"{change} ({memory_plan.gib(total)})" for change, total in totals if total <= budget]
        if not fits:
            return "No single change of micro batch, sequence length, nodes, ZeRO stage or method fits: combine them"
        return "Each of these would fit: " + "; ".join(fits)

    def choices(self) -> list[tuple[int, bool]]:
        """(ZeRO stage, checkpointing), fastest first, as far as the recipe leaves them open."""
        t = self.recipe.training
        method = self.recipe.method.kind
        # QLoRA under ZeRO-3 (4-bit weights partitioned) is not proven in ft: never chosen for it.
        stages = [2, 3] if method == Method.full.value else [1, 2] if method == Method.qlora.value else [1, 2, 3]
        if t.zero_stage is not None:
            stages = [t.zero_stage]
        elif t.compile:
            stages = [stage for stage in stages if stage != 3]
        ordered = [(stage, checkpointing) for checkpointing in (False, True) for stage in stages[:1]] + \
                  [(stage, checkpointing) for stage in stages[1:] for checkpointing in (False, True)]
        if t.gradient_checkpointing is not None:
            ordered = [choice for choice in ordered if choice[1] == t.gradient_checkpointing]
        return ordered

    def setup(self, stage: int, checkpointing: bool, world: int) -> memory_plan.Setup:
        r = self.recipe
        dpo = r.objective.kind == Objective.dpo.value
        return memory_plan.Setup(
            method=r.method.kind, lora_rank=r.method.rank or 0,
            lora_targets=tuple(r.method.target_modules or LLAMA_TARGETS), zero_stage=stage, ranks=world,
            micro_batch=r.training.micro_batch, seq_len=r.data.max_seq_len, precision=r.training.precision,
            checkpointing=checkpointing, ft_loss=not dpo and stage != 3 and r.training.precision != "fp16",
            on_gpu=not self.profile.cpu_workers_per_node,
            rows_per_unit=2 if dpo else 1, packed=r.packed)

    def size_rules(self, size: float | None, no_plan: str) -> None:
        big = (size or 0) >= 13
        if self.recipe.method.kind == Method.full.value:
            self.default("training.zero_stage", 3 if big else 2, "ZeRO-3 shards a large full fine-tune" if big
                         else "ZeRO-2: optimizer state and gradients sharded")
        else:  # the adapters' gradients are small: sharding them saves little and costs a hook per tensor
            self.default("training.zero_stage", 1, "ZeRO-1 for adapters: their optimizer state sharded, their "
                                                   "gradients reduced in one collective (GPU.md)")
        self.default("training.gradient_checkpointing", (size or 0) >= 7,
                     f"on for models of 7B and more (no memory plan: {no_plan})")

    def check_resources(self) -> None:
        r, p = self.recipe.resources, self.profile
        if r.gpus_per_node > p.gpus_per_node:
            self.problem("resources.gpus_per_node",
                         f"{r.gpus_per_node} GPUs per node, but {p.name} nodes have {p.gpus_per_node}; "
                         f"use at most {p.gpus_per_node} (and more nodes)")
        if p.max_nodes and r.nodes > p.max_nodes:
            self.problem("resources.nodes", f"{r.nodes} nodes, but {p.name} has {p.max_nodes}")
        if r.tier not in p.tiers:
            self.problem("resources.tier", f"{p.name} has no {r.tier} tier; tiers: {', '.join(p.tiers)}")


def resolve(path: Path, cluster: str | None = None) -> ResolvedRecipe:
    """Load, validate, fill defaults and check a recipe against its cluster profile."""
    recipe, source = load_recipe(path)
    sources = {dotted: "recipe" for dotted, _ in _flatten(recipe.model_dump(mode="json"))
               if tuple(dotted.split(".")) in source.lines}
    for role, value in recipe.data_files().items():  # local data paths are relative to the recipe file
        if "://" not in value and not Path(value).is_absolute():
            section, field = DATA_FILES[role]
            # absolute(), not resolve(): a symlink loop in the path is the data check's to report.
            setattr(getattr(recipe, section), field, os.path.normpath(path.parent.absolute() / value))
            sources[f"{section}.{field}"] = "recipe (relative to the recipe file)"
    chosen = cluster or recipe.cluster
    try:
        profile = load_profile(chosen)
    except FtError as exc:
        if cluster or not recipe.cluster:
            raise
        line = source.line_of(("cluster",))
        hint = f" ({exc.hint})" if exc.hint else ""
        raise RecipeError([f"{path}:{line}: cluster: {exc.message}{hint}"]) from None
    resolver = _Resolver(recipe, source, profile,
                         "--cluster" if cluster else "recipe" if recipe.cluster else "site default")
    sources.update(resolver.run())
    if cluster:
        recipe.cluster = profile.name
        sources["cluster"] = "--cluster"
    elif recipe.cluster is None:
        recipe.cluster = profile.name
        sources["cluster"] = "default: this site's profile" if profile.name != "lab" else "default: the local lab"
    if resolver.problems:
        raise RecipeError(resolver.problems)
    derived = derive(recipe, profile)
    if derived.job_mtbf_hours:
        sources["checkpoint.every_minutes"] = f"recipe: {auto_cadence_example(derived.job_mtbf_hours, profile)}"
    for dotted, _ in _flatten(recipe.model_dump(mode="json")):
        sources.setdefault(dotted, "default: schema")
    return ResolvedRecipe(recipe, profile, path, derived, sources, resolver.memory)


def auto_cadence_example(job_mtbf_hours: float, profile: CadenceSite) -> str:
    """What `every_minutes: auto` will choose, before any save was measured: for two save costs."""
    cadence = AutoCadence(job_mtbf_hours)
    examples = ", ".join(f"a {cost:g} s save -> every {cadence.interval_s(cost, 0) / 60:.0f} min" for cost in (1, 30))
    return (f"Young/Daly from the save cost measured as the run goes and a failure every {job_mtbf_hours:.0f} h "
            f"(node MTBF {profile.node_mtbf_hours:g} h over the job's nodes): {examples}")


def rank_budget(profile: SchedulerSite, workers: int) -> int | None:
    """What one rank may plan to hold: a GPU's memory less its CUDA context (~1 GiB, outside what
    torch allocates) and 5% for the allocator's fragments; a CPU rank's share of its node, less 10%
    for the node's own processes. None: not known."""
    if profile.cpu_workers_per_node:
        if not profile.memory_per_node_mb:
            return None
        return int(profile.memory_per_node_mb * 2**20 / max(1, workers) * 0.9)
    if not profile.gpu_memory_gib:
        return None
    return int((profile.gpu_memory_gib - 1.0) * 0.95 * memory_plan.GIB)


def workers_per_node(recipe: Recipe, profile: SchedulerSite) -> int:
    return profile.cpu_workers_per_node or recipe.resources.gpus_per_node or 1


def derive(recipe: Recipe, profile: ClusterProfile) -> Derived:
    """Every value that follows from the resolved recipe and its cluster: computed here only."""
    workers = workers_per_node(recipe, profile)
    world = recipe.resources.nodes * workers
    tier = profile.tiers[recipe.resources.tier]
    held = recipe.resources.nodes + recipe.resources.spare_nodes  # a spare fails as often as any node
    return Derived(workers_per_node=workers, world_size=world,
                   gradient_accumulation=batch_plan(recipe.training, world).gradient_accumulation,
                   out_of_memory_micro_batch=batch_plan(recipe.training, world, out_of_memory_retry=True).micro_batch,
                   partition=tier.partition, qos=tier.qos,
                   job_mtbf_hours=(round(profile.node_mtbf_hours / held, 2)
                                   if recipe.checkpoint.every_minutes == "auto" else None))
