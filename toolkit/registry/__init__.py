"""The adapter registry: LoRA adapters as immutable versions on the shared filesystem (addressed by the
hash of their files), mirrored to the object store, each a draft, promoted or deprecated; and the
handoff a LoRA serving fleet loads. Users see it through `ft adapters`; a run calls the two functions
below at its end (rank 0, after its evaluation).

    from toolkit.registry import promote, register_run_adapter
    from toolkit.registry.records import AdapterRecord
    from toolkit.registry.store import PromotionRefused

    version = register_run_adapter(shared_root, run_dir, AdapterRecord(...), s3_prefix)   # a draft
    try:
        promote(shared_root, version.id, "its gates passed", s3_prefix)
    except PromotionRefused as refused:   # failed gates: kept as a draft, and why
        log(refused.message)

Layout: toolkit/registry/layout.py; who may do what: toolkit/registry/store.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

# Nothing imported here beyond the standard library: `ft` loads toolkit.registry.states at start.
if TYPE_CHECKING:
    from toolkit.registry.records import AdapterRecord
    from toolkit.registry.store import Change, Registry, Version


def register_run_adapter(shared_root: str, run_dir: Path, record: AdapterRecord, s3_prefix: str = "",
                         warn: Callable[[str], None] = print) -> Version:
    """The run's adapter (<run dir>/output/) as a draft version, mirrored under `s3_prefix` (in a job,
    the cluster's s3_prefix, from the run spec; the endpoint and credentials are the job's AWS_*). An upload that
    fails is said through `warn` and done by a later `ft adapters sync`; the version is registered.
    AdapterRefused (a full fine-tune's weights, no adapter_config.json) or RegistryError otherwise."""
    from toolkit.runs.layout import RunLayout

    return _registry(shared_root, s3_prefix, warn).register(RunLayout(Path(run_dir)).output, record)


def promote(shared_root: str, version_id: str, reason: str = "", s3_prefix: str = "",
            warn: Callable[[str], None] = print) -> Change:
    """Promote a version as this process's user (who must own its name, or be root): PromotionRefused,
    saying why, for one whose gates failed, whose files changed, or that was deprecated."""
    return _registry(shared_root, s3_prefix, warn).promote(version_id, reason)


def _registry(shared_root: str, s3_prefix: str, warn: Callable[[str], None]) -> Registry:
    from toolkit.registry.mirror import RegistryMirror
    from toolkit.registry.store import Registry

    return Registry.for_shared_root(shared_root, RegistryMirror.for_prefix(s3_prefix), warn)
