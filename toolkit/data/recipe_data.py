"""Validate the data a recipe names, with the recipe's tokenizer, limits and objective."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from toolkit.base.shared_dirs import SharedFolderError, user_cache
from toolkit.data.cache import TokenCache, cache_key, file_digest
from toolkit.data.tokenizer import LengthCounter, TokenizerNotFound, load_length_counter
from toolkit.data.validate import (
    MAX_ROWS_BY_TIER,
    CacheTarget,
    Finding,
    Limits,
    Report,
    report_from_dict,
    validate_file,
)
from toolkit.recipe.resolve import ResolvedRecipe
from toolkit.recipe.schema import DATA_FILES
from toolkit.storage.object_store import ObjectStore

FORMATS_FOR = {"sft": {"prompt_completion", "chat"}, "dpo": {"preference"}}


def tokenizer_for(resolved: ResolvedRecipe, override: str | None = None) -> tuple[LengthCounter | None, str | None]:
    """The recipe's tokenizer, or None and why (length checks are then skipped with a warning)."""
    spec, profile = override or resolved.recipe.model.base, resolved.profile
    revision = None if override else resolved.recipe.model.revision
    if revision and not Path(spec).exists():
        spec = f"{spec}@{revision}"  # the cache entry of that revision (and the store's)
    try:
        cache = user_cache(profile.shared_root) if profile.s3_models else None
    except SharedFolderError:
        cache = None
    try:
        return load_length_counter(spec, profile.shared_root, profile.s3_models, cache,
                                   store=profile.object_store), None
    except TokenizerNotFound as exc:
        return None, str(exc)


def token_cache(user_cache: Path) -> TokenCache:
    """In the user's own cache: tokenized data is the user's data, and a report in the cache decides
    whether their data passes validation, so no other user may read or plant entries there."""
    return TokenCache(user_cache / "tokenized")


def login_token_cache(shared_root: str) -> tuple[TokenCache | None, str | None]:
    """The token cache validation fills, or None and why it cannot be used (validation then goes on
    without it: the workers tokenize the data themselves)."""
    try:
        return token_cache(user_cache(shared_root)), None
    except SharedFolderError as exc:
        return None, f"the token cache is not used: {exc.message} ({exc.hint})"


def held_out_fraction(recipe, role: str) -> float:
    """Share of the training file held out for evaluation: only when the recipe names no eval file."""
    return recipe.data.eval_fraction if role == "train" and not recipe.data.eval else 0.0


def dataset_key(recipe, path: str, counter: LengthCounter, role: str, store: ObjectStore) -> str:
    return cache_key(file_digest(path, store), counter.identity, recipe.data.format, recipe.data.max_seq_len,
                     recipe.data.too_long, held_out_fraction(recipe, role), recipe.training.seed)


def validated_file(recipe, role: str, path: str, counter: LengthCounter | None, cache: TokenCache | None,
                   progress: Callable[[str, int, int | None], None] | None, store: ObjectStore) -> Report:
    """The report of one data file: from the cache when this file, tokenizer and settings were
    validated before; else a fresh pass, whose tokens fill the cache when the file is clean."""
    key = dataset_key(recipe, path, counter, role, store) if counter and cache else None
    cached = cache.meta(key) if key else None
    if cached and cached.get("report"):  # a cache a worker built holds tokens but no report
        return report_from_dict(cached["report"])
    limits = Limits(max_seq_len=recipe.data.max_seq_len, too_long=recipe.data.too_long,
                    min_rows=100 if role == "train" else 1, max_rows=MAX_ROWS_BY_TIER.get(recipe.resources.tier))
    on_bytes = (lambda done, total: progress(role, done, total)) if progress else None
    target, unwritable = None, None
    if key:
        try:
            target = CacheTarget(cache.writer(key), held_out_fraction(recipe, role), recipe.training.seed)
        except OSError as exc:  # a read-only or full cache: validation goes on without it
            unwritable = f"the token cache {cache.root} is not used: it cannot be written ({exc.strerror or exc})"
    report = validate_file(path, recipe.data.format, counter, limits, progress=on_bytes, cache=target, store=store)
    if unwritable:
        report.add("warning", "token_cache_unusable", Finding(path, None, unwritable))
    if target and report.ok:
        target.writer.finish({"key": key, "path": path, "format": report.format, "report": report.to_dict()})
    elif target:
        target.writer.abort()
    return report


def missing_file_report(resolved: ResolvedRecipe, role: str, path: str, unreachable: str | None) -> Report:
    report = Report(path, None)
    field = ".".join(DATA_FILES[role])
    where = resolved.profile.object_store.where(path)
    if unreachable:
        report.add("error", "object_store_unreachable", Finding(
            str(resolved.path), field,
            f"{path}: {where} could not be reached ({unreachable}); check the endpoint (AWS_ENDPOINT_URL, or "
            f"s3_endpoint in the {resolved.profile.name} cluster profile), the network and the credentials"))
    else:
        report.add("error", "file_not_found", Finding(str(resolved.path), field,
                                                      f"{path}: no such file ({where})"))
    return report


def validate_recipe_data(resolved: ResolvedRecipe, tokenizer: str | None = None,
                         progress: Callable[[str, int, int | None], None] | None = None) -> list[Report]:
    """Validate the recipe's data files (train, eval, golden). A file already validated with the same tokenizer
    and settings is not read again: its report and tokens come from the cache."""
    recipe = resolved.recipe
    store = resolved.profile.object_store
    counter, missing = tokenizer_for(resolved, tokenizer)
    cache, cache_unusable = login_token_cache(resolved.profile.shared_root)
    reports = []
    for role, path in recipe.data_files().items():
        found = store.presence(path)
        if not found.found:
            reports.append(missing_file_report(resolved, role, path, found.unreachable))
            continue
        report = validated_file(recipe, role, path, counter, cache, progress, store)
        if cache_unusable:
            report.add("warning", "token_cache_unusable", Finding(path, None, cache_unusable))
        # What the recipe asks of the data is checked on every report, cached or fresh.
        if missing:
            report.add("warning", "lengths_not_checked", Finding(path, None, f"token lengths not checked: {missing}"))
        allowed = FORMATS_FOR[recipe.objective.kind]
        if report.format and report.format not in allowed:
            report.add("error", "format_objective_mismatch", Finding(
                path, None, f"{report.format} data cannot train the {recipe.objective.kind} objective; "
                            f"it needs {' or '.join(sorted(allowed))}"))
        reports.append(report)
    return reports
