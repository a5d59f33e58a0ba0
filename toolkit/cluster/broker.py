"""Where a run should go: every configured cluster profile and tier that fits a recipe, when its job
would start, what it would cost and when it would end (`ft plan`), and the choice by the user's
preference (`ft submit --cluster auto`).

A profile fits when the recipe resolves against it (GPUs per node, nodes, the tier exists). Where
this host's Slurm has the tier's partition, Slurm itself answers for the job as it would be
submitted: `sbatch --test-only` of the rendered script says when it would start, or why it never
could (a time limit over the partition's, more nodes than it has). Elsewhere (a cluster this login
node does not reach) the start is unknown and said so.

The cost is the most the job can cost: its GPUs for its whole time limit, at the profile's price
per GPU-hour (the tier's, where it has its own); the finish is its start plus that limit. Among
equals, the recipe's own tier. A run that ends sooner costs less, in the
same proportion on every cluster, so the ranking holds.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from pathlib import Path

from toolkit.base.errors import FtError
from toolkit.slurm import commands
from toolkit.slurm import jobs as slurm_jobs
from toolkit.slurm import nodes as slurm_nodes


class Preference(StrEnum):
    cheapest = "cheapest"  # the least cost among options starting within the wait allowed
    soonest = "soonest"


DEFAULT_MAX_WAIT_S = 1800.0  # the cheapest option, if it starts within this; else the soonest


@dataclass
class Option:
    cluster: str
    tier: str
    partition: str
    gpus: int
    hours: float  # the job's time limit
    price: float  # per GPU-hour
    start: float | None = None  # Slurm's expected start; None where this host cannot ask
    asked: bool = False  # the recipe's own tier: the choice among equals
    fits: bool = True
    why: str = ""  # why it does not fit, or how the start is known

    @property
    def cost(self) -> float:
        return self.gpus * self.hours * self.price

    @property
    def finish(self) -> float | None:
        return None if self.start is None else self.start + self.hours * 3600

    def to_dict(self) -> dict:
        return dataclasses.asdict(self) | {"cost": round(self.cost, 2), "finish": self.finish}


def local_partitions(run: Callable = commands.run) -> set[str]:
    """The partitions this host's Slurm has (none where there is no Slurm)."""
    try:
        return slurm_nodes.partition_names(run)
    except FtError:
        return set()


def local_profiles(profiles: dict, run: Callable = commands.run) -> set[str]:
    """The profiles of the cluster this host's Slurm is: the one named as Slurm names its cluster, the
    site's profile, and the user's profiles that extend either (a priced copy, another partition).
    Another cluster's profile may name partitions of the same names: this Slurm cannot speak for it."""
    from toolkit.cluster.profile import read_user_entries, site_profile_name

    roots = set()
    try:
        config = slurm_nodes.config(run, timeout=10)
        roots |= {config["ClusterName"]} if config.get("ClusterName") else set()
    except FtError:
        return set()  # no Slurm here: no profile's start can be asked
    try:
        roots |= {site_profile_name()} - {None}
        entries = read_user_entries()
    except (OSError, FtError):  # a broken or unreadable profiles file: `ft cluster ls` says how
        entries = {}

    def reaches(name: str, seen: frozenset) -> bool:
        parent = (entries.get(name) or {}).get("extends") if isinstance(entries.get(name), dict) else None
        if name in roots and (parent in (None, name) or name not in entries):
            return True
        return isinstance(parent, str) and parent not in seen and reaches(parent, seen | {name})

    return {name for name in profiles if reaches(name, frozenset())}


def expected_start(script: str, run: Callable = commands.run) -> tuple[float | None, str]:
    """Slurm's word on a script: when it would start (its backfill plan), or why it never could."""
    with tempfile.NamedTemporaryFile("w", suffix=".sbatch", prefix="ft-plan-") as handle:
        handle.write(script)
        handle.flush()
        plan = slurm_jobs.test_only(Path(handle.name), run)
    if plan.start is None:  # "Unknown": it fits, and Slurm has no plan for it yet
        return None, "Slurm accepts it, with no start time yet"
    return plan.start, f"Slurm: on {plan.nodes}"


def options(recipe_path: Path, profiles: dict, run: Callable = commands.run) -> list[Option]:
    """Every profile and tier, each with whether it fits, its start, price and cost."""
    from toolkit.recipe.resolve import load_recipe, resolve
    from toolkit.render.sbatch import RunPlacement, render

    load_recipe(recipe_path)  # the recipe's own errors, once, located (not as every profile's misfit)
    partitions = local_partitions(run)
    here = local_profiles(profiles, run)
    found = []
    for name, profile in sorted(profiles.items()):
        try:
            resolved = resolve(recipe_path, name)
        except FtError as error:  # the recipe does not fit this profile (its GPUs, its nodes)
            found.append(Option(name, "-", "-", 0, 0.0, profile.price_per_gpu_hour, fits=False, why=error.message))
            continue
        from toolkit.account import quota
        from toolkit.account.usage import allocated_gpus

        resources = resolved.recipe.resources
        gpus = allocated_gpus(resources)
        over_cap = ""
        if name in here:  # this Slurm's accounting: the account's cap (another cluster's is its own)
            try:
                quota.check(resolved, run)
            except quota.QuotaExceeded as error:
                over_cap = error.message
        for tier, target in profile.tiers.items():
            price = profile.price_per_gpu_hour if target.price_per_gpu_hour is None else target.price_per_gpu_hour
            option = Option(name, tier, target.partition, gpus, resources.time_limit_seconds() / 3600, price,
                            asked=tier == str(resources.tier))
            found.append(option)
            if name not in here or target.partition not in partitions:
                option.why = "start unknown: not this host's Slurm"
                continue
            if over_cap:
                option.fits, option.why = False, over_cap
                continue
            with tempfile.TemporaryDirectory(prefix="ft-plan-") as folder:
                script = render(resolved.with_tier(tier), RunPlacement("ft-plan", folder, None))
                try:
                    option.start, option.why = expected_start(script, run)
                except (ValueError, FtError) as error:
                    option.fits, option.why = False, str(getattr(error, "message", error))
    return found


def choose(found: list[Option], prefer: Preference = Preference.cheapest, max_wait_s: float = DEFAULT_MAX_WAIT_S,
           now: float | None = None) -> tuple[Option, str]:
    """The option to submit to, and why, in words a person would check. `cheapest`: the least cost
    among those Slurm expects to start within `max_wait_s` (else the soonest of all); `soonest`: the
    earliest start (then the least cost). Options whose start this host cannot know are not chosen
    automatically: submitting there is the user's call (ft submit --cluster NAME)."""
    now = time.time() if now is None else now
    known = [option for option in found if option.fits and option.start is not None]
    if not known:
        raise FtError("no cluster profile and tier both fits the recipe and has a start Slurm can tell from here",
                      hint="ft plan RECIPE shows each option and why; submit with --cluster NAME")
    soonest = min(known, key=lambda o: (o.start, o.cost, not o.asked, o.cluster, o.tier))
    if prefer == Preference.soonest:
        return soonest, f"the soonest start ({stamp(soonest.start)}) of {len(known)} options"
    soon = [option for option in known if option.start - now <= max_wait_s]
    if not soon:
        return soonest, (f"none starts within {max_wait_s / 60:.0f} min: the soonest ({stamp(soonest.start)}), "
                         f"${soonest.cost:,.2f}")
    # Among equal costs the recipe's own tier (another would preempt others, or be preempted), then the sooner.
    cheapest = min(soon, key=lambda o: (o.cost, not o.asked, o.start, o.cluster, o.tier))
    dearer_waits = [o for o in known if o.cost < cheapest.cost]  # cheaper, but not soon enough
    why = f"the cheapest (${cheapest.cost:,.2f}) that starts within {max_wait_s / 60:.0f} min ({stamp(cheapest.start)})"
    if not cheapest.asked:
        why += f"; tier {cheapest.tier}, not the recipe's"
    if dearer_waits:
        waiting = min(dearer_waits, key=lambda o: o.cost)
        why += (f"; {waiting.cluster}/{waiting.tier} costs ${waiting.cost:,.2f} but would not start before "
                f"{stamp(waiting.start)}")
    return cheapest, why


def stamp(when: float | None) -> str:
    return "unknown" if when is None else datetime.fromtimestamp(when).strftime("%Y-%m-%d %H:%M")
