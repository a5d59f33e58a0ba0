"""The end of a run, on rank 0 after its evaluation: a LoRA adapter into the registry (a draft,
promoted where the evaluation passed the recipe's gates), where it went beside the evaluation, and
the receipt's last entry, sealed. Nothing here fails the run: a registry that refuses is said in the
log and in eval.json, and the adapter stays in the run's output folder."""

from __future__ import annotations

import os
from collections.abc import Callable

from toolkit.base.errors import FtError
from toolkit.receipts import entries as receipt_entries
from toolkit.recipe.schema import Recipe
from toolkit.runs.layout import RunLayout

ADAPTERS = ("lora", "qlora")  # a full fine-tune's weights are a model, not an adapter a registry serves


def publish(layout: RunLayout, recipe: Recipe, evaluation: dict | None, step: int, log: Callable[[str], None]) -> None:
    registry = None
    try:
        registry = register(layout, recipe, evaluation, log) if recipe.method.kind in ADAPTERS else None
        if evaluation is not None and registry is not None:
            from toolkit.train.evaluation import write_json

            write_json(layout.evaluation, evaluation | {"registry": registry})
    except (FtError, OSError) as exc:  # a full disk, a stale handle: the run's adapter is made all the same
        log(f"the registry's part of the run's end did not complete: {getattr(exc, 'message', exc)}")
    finally:
        receipt_entries.finished(layout.root, step, registry)


def register(layout: RunLayout, recipe: Recipe, evaluation: dict | None, log: Callable[[str], None]) -> dict:
    """The adapter as a registry version, promoted when the evaluation says so: {"version", "state",
    "why"} (or {"error"} where the registry refused it)."""
    from toolkit.data.cache import file_digest
    from toolkit.registry import promote, register_run_adapter
    from toolkit.registry.records import AdapterRecord
    from toolkit.train.dataset import JOB_STORE

    site = layout.read_spec().site
    shared_root, s3_prefix = site.shared_root_of(layout.root), site.s3_prefix
    warn = lambda message: log(f"registry: {message}")  # noqa: E731
    try:
        record = AdapterRecord(name=recipe.name, base_model=recipe.model.base, base_revision=recipe.model.revision,
                               account=os.environ.get("SLURM_JOB_ACCOUNT") or recipe.resources.account,
                               run_id=os.environ.get("FT_RUN_ID") or layout.root.name,
                               data_digests={path: file_digest(path, JOB_STORE)
                                             for path in recipe.data_files().values()},
                               eval=evaluation or {})
        version = register_run_adapter(shared_root, layout.root, record, s3_prefix, warn)
    except (FtError, OSError, ValueError) as exc:  # ValueError: pydantic's, a record the registry refuses
        log(f"the adapter was not registered: {getattr(exc, 'message', exc)}")
        return {"error": str(getattr(exc, "message", exc))}
    found = {"version": version.id, "state": str(version.state), "name": recipe.name}
    if evaluation and evaluation.get("state") == "promoted":
        try:
            promote(shared_root, version.id, f"run {record.run_id}: {evaluation.get('why', '')}"[:500], s3_prefix, warn)
            found["state"] = "promoted"
        except (FtError, OSError, TimeoutError) as exc:
            found["why"] = str(getattr(exc, "message", exc))
            log(f"the adapter stays a draft in the registry: {found['why']}")
    log(f"registry: {recipe.name} version {version.id[:12]} {found['state']}")
    return found
