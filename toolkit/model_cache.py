"""Where models are cached on a cluster, in the order they are looked up: node-local disk, then the
shared filesystem. Read by both sides: validation finds a model's tokenizer here, workers its weights."""

from __future__ import annotations

import os
from pathlib import Path


def shared_models(shared_root: str) -> Path:
    """The shared filesystem's tier: where ft builds the tiny model and downloads from the hub."""
    return Path(shared_root) / "models"


def cache_dirs(shared_root: str) -> list[Path]:
    """The model cache tiers to read, node-local first. The default node-local folder is per user: a
    shared, world-writable one would let any user plant a model (and its chat template) for everyone."""
    local = Path(os.environ.get("FT_MODEL_CACHE_LOCAL") or f"/tmp/ft-model-cache-{os.getuid()}")
    return [tier for tier in (local, shared_models(shared_root)) if trusted_cache_dir(tier)]


def trusted_cache_dir(folder: Path) -> bool:
    """A cache tier is read only when not every user may write to it (a site's shared cache may
    well be owned by a service account and writable by a group)."""
    try:
        return not folder.stat().st_mode & 0o002
    except OSError:
        return True  # not there (yet): nothing to trust or distrust
