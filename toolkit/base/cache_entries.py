"""The rule every cache ft keeps follows (models, tokenized data, compiled ops): an entry is built in
a staging folder beside its final place, checked, and renamed into place whole; an entry that is not
whole is moved aside (a rename is atomic: no reader ever sees it half deleted) and deleted; one
builder at a time, under a flock that the kernel releases when its holder dies.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def exclusive(lock_file: Path) -> Iterator[None]:
    """Hold the lock of one cache entry (or of a whole cache)."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def staging_path(final: Path, purpose: str = "building") -> Path:
    """A name no other process, on this node or another, will pick."""
    return final.with_name(f".{purpose}-{final.name}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")


def discard(path: Path) -> None:
    """Remove an entry that is not to be trusted: files and symlinks at once, folders after moving
    them aside."""
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return
    doomed = path.with_name(f".discarded-{path.name}-{os.getpid()}-{time.time_ns()}")
    try:
        path.rename(doomed)
    except FileNotFoundError:  # another process discarded it first
        return
    shutil.rmtree(doomed, ignore_errors=True)
