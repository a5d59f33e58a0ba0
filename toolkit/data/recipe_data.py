"""Validate the data a recipe names, with the recipe's tokenizer, limits and objective."""

from __future__ import annotations

from collections.abc import Callable

from toolkit.data.tokenizer import LengthCounter, TokenizerNotFound, load_length_counter
from toolkit.data.validate import MAX_ROWS_BY_TIER, Finding, Limits, Report, validate_file
from toolkit.recipe.resolve import ResolvedRecipe

FORMATS_FOR = {"sft": {"prompt_completion", "chat"}, "dpo": {"preference"}}


def tokenizer_for(resolved: ResolvedRecipe, override: str | None = None) -> tuple[LengthCounter | None, str | None]:
    """The recipe's tokenizer, or None and why (length checks are then skipped with a warning)."""
    try:
        return load_length_counter(override or resolved.recipe.model.base, resolved.profile.shared_root), None
    except TokenizerNotFound as exc:
        return None, str(exc)


def validate_recipe_data(resolved: ResolvedRecipe, tokenizer: str | None = None,
                         progress: Callable[[str, int, int | None], None] | None = None) -> list[Report]:
    recipe = resolved.recipe
    counter, missing = tokenizer_for(resolved, tokenizer)
    reports = []
    for role in ("train", "eval"):
        path = getattr(recipe.data, role)
        if not path:
            continue
        limits = Limits(max_seq_len=recipe.data.max_seq_len, too_long=recipe.data.too_long,
                        min_rows=100 if role == "train" else 1, max_rows=MAX_ROWS_BY_TIER.get(recipe.resources.tier))
        on_bytes = (lambda done, total, role=role: progress(role, done, total)) if progress else None
        report = validate_file(path, recipe.data.format, counter, limits, progress=on_bytes)
        if missing:
            report.add("warning", "lengths_not_checked", Finding(path, None, f"token lengths not checked: {missing}"))
        allowed = FORMATS_FOR[recipe.objective.kind]
        if report.format and report.format not in allowed:
            report.add("error", "format_objective_mismatch", Finding(
                path, None, f"{report.format} data cannot train the {recipe.objective.kind} objective; "
                            f"it needs {' or '.join(sorted(allowed))}"))
        reports.append(report)
    return reports
