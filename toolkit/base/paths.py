"""Where ft finds its own resources and keeps its local state."""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # toolkit/


def resource_dir(name: str) -> Path:
    """A top-level resource folder (ansible, sbatch_templates): from the source tree, else the wheel."""
    for candidate in (_PACKAGE.parent / name, _PACKAGE / "_data" / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"ft's {name}/ folder is missing from this installation ({_PACKAGE})")


def state_home() -> Path:
    """Per-user state (logs of ft's own actions): $FT_STATE_HOME or ~/.local/state/ft."""
    base = os.environ.get("FT_STATE_HOME") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "ft"
    )
    return Path(base)
