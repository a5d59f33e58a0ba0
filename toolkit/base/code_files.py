"""The files of ft's own code a long-running process loads, and their digest: a daemon started
before one of them changed runs the old code.

ft's daemons (the receipt signer, the cluster exporter) are started by Ansible, which restarts a
daemon started before a file it reads changed (ft.cluster.daemon's `config_files`; systemd units on
a change of this file). The roles write this record beside the daemon's command line:

    python -m toolkit.base.code_files toolkit.services.signer
    {"files": [... ft's files the module loads ...], "digest": "<sha256 of their paths and contents>"}

The record changes only when the code does, so a provisioning run restarts the daemon then and
only then. `ft lab status` hashes the same files again (the lab manifest's `code` of a daemon): a
digest that differs from the record means the daemon runs code older than the checkout, and
`ft lab up` restarts it.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import sys
from pathlib import Path

from toolkit.base.digests import sha256_file


def loaded_by(module: str) -> list[str]:
    """ft's source files loaded once `module` is imported (at module level: a daemon's module
    imports at the top what it serves with)."""
    importlib.import_module(module)
    files = {getattr(sys.modules[name], "__file__", None) for name in list(sys.modules)
             if name == "toolkit" or name.startswith("toolkit.")}
    return sorted(str(Path(file).resolve()) for file in files if file)


def digest(files: list[str]) -> str:
    """Of the files' paths and contents; a file gone (or not a file) counts as such, not as an error.
    PermissionError is raised: this user cannot tell what the file holds."""
    hashed = hashlib.sha256()
    for file in files:
        hashed.update(file.encode() + b"\0")
        try:
            hashed.update(sha256_file(Path(file)).encode())
        except PermissionError:
            raise
        except OSError:
            hashed.update(b"<unreadable>")
    return hashed.hexdigest()


def record(modules: list[str]) -> dict:
    files = sorted({file for module in modules for file in loaded_by(module)})
    return {"files": files, "digest": digest(files)}


def runs_old_code(record_path: str) -> bool:
    """The record's files no longer hash to its digest, or there is no record to read. False where
    this user may not read the record or a file of it: only one who can read them can tell (root)."""
    try:
        written = json.loads(Path(record_path).read_text())
        files = written["files"]
        if not isinstance(files, list) or not all(isinstance(file, str) for file in files):
            return True
        return digest(files) != written["digest"]
    except PermissionError:
        return False
    except (OSError, ValueError, KeyError, TypeError):
        return True


if __name__ == "__main__":
    print(json.dumps(record(sys.argv[1:])))
