"""Where models are cached on a cluster, in the order they are looked up: node-local disk, then the
shared filesystem. Read by both sides: validation finds a model's tokenizer here, workers its weights."""

from __future__ import annotations

import os
from pathlib import Path

from toolkit.shared_dirs import shared_root_path, trusted_owner_dir


def shared_models(shared_root: str) -> Path:
    """The shared filesystem's tier, which the site's admins fill (and ft, where the hub may be used)."""
    return shared_root_path(shared_root) / "models"


def cache_dirs(shared_root: str) -> list[Path]:
    """The model cache tiers to read, node-local first. The default node-local folder is per user; a
    tier is read only when it is a real folder of root's or this user's (another user could plant a
    model, and its chat template, in a folder of theirs that has a name ft looks for)."""
    local = Path(os.environ.get("FT_MODEL_CACHE_LOCAL") or f"/tmp/ft-model-cache-{os.getuid()}")
    return [tier for tier in (local, shared_models(shared_root)) if trusted_owner_dir(tier)]
