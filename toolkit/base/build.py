"""Which ft this is, to the byte: the version number alone does not tell a checkout edited since the
compute nodes' environment was built from it (`ft doctor` compares the two sides)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from toolkit.base.paths import resource_dir

# The one place ft's version is spelled: pyproject.toml reads it (tool.hatch.version), and
# `toolkit.__version__` is this.
VERSION = "0.1.0"

_PACKAGE = Path(__file__).resolve().parents[1]  # toolkit/


def _files() -> list[tuple[str, Path]]:
    """The code a job runs: the package's Python files and the job templates, by a name that is the
    same in a checkout and in an installed wheel (where the templates sit under _data/)."""
    named = [(str(path.relative_to(_PACKAGE)), path) for path in _PACKAGE.rglob("*.py")
             if "_data" not in path.relative_to(_PACKAGE).parts]
    templates = resource_dir("sbatch_templates")
    named += [(f"sbatch_templates/{path.relative_to(templates)}", path) for path in templates.rglob("*.j2")]
    return sorted(named)


def build_id() -> str:
    """ft's version and a digest of its code, e.g. 0.1.0+3f2a9c01d4e5."""
    digest = hashlib.sha256()
    for name, path in _files():
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return f"{VERSION}+{digest.hexdigest()[:12]}"


if __name__ == "__main__":
    print(build_id())
