"""Checkpoints that a crash can never corrupt.

A checkpoint is written under checkpoints/.staging/<tag>, every file is flushed, a manifest with
the size and sha256 of each file is added, and only then is the folder renamed to
checkpoints/<tag> and the `latest` pointer moved (last, atomically). On start, the newest
checkpoint whose manifest verifies is used; a corrupt or truncated one is skipped with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
LATEST = "latest"
STAGING = ".staging"


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def step_of(tag: str) -> int:
    return int(tag.removeprefix("step-"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb+") as handle:
                os.fsync(handle.fileno())
    descriptor = os.open(root, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_manifest(folder: Path, step: int) -> None:
    files = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}
    (folder / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))


def verify(folder: Path) -> str | None:
    """None when every file of the checkpoint is there, whole and unchanged; else what is wrong."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return "no readable manifest (the write never finished)"
    for name, expected in manifest["files"].items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{name} is {path.stat().st_size} bytes, the manifest says {expected['bytes']}"
        if _sha256(path) != expected["sha256"]:
            return f"{name} does not match its sha256"
    return None


@dataclass
class CheckpointStore:
    root: Path
    keep_last: int

    @property
    def staging(self) -> Path:
        return self.root / STAGING

    def tags(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted((p.name for p in self.root.iterdir() if p.is_dir() and p.name.startswith("step-")),
                      key=step_of, reverse=True)

    def latest_pointer(self) -> str | None:
        try:
            return (self.root / LATEST).read_text().strip() or None
        except OSError:
            return None

    def choose(self, warn) -> str | None:
        """The checkpoint to resume from: the newest that verifies."""
        for tag in self.tags():
            problem = verify(self.root / tag)
            if problem is None:
                return tag
            warn(f"checkpoint {tag} is unusable ({problem}); trying the one before")
        return None

    def prepare(self) -> None:
        """Clear what an interrupted save left behind (rank 0, before every save)."""
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(parents=True, exist_ok=True)

    def publish(self, step: int) -> Path:
        """Make a fully written staging checkpoint the latest one (rank 0, after every rank saved)."""
        tag = tag_for(step)
        staged = self.staging / tag
        write_manifest(staged, step)
        _fsync_tree(staged)
        final = self.root / tag
        if final.exists():
            shutil.rmtree(final)
        staged.rename(final)
        pointer = self.root / f".{LATEST}.tmp"
        pointer.write_text(tag + "\n")
        with open(pointer, "rb+") as handle:
            os.fsync(handle.fileno())
        pointer.replace(self.root / LATEST)  # the pointer moves last
        self.prune()
        return final

    def prune(self) -> None:
        for tag in self.tags()[self.keep_last:]:
            shutil.rmtree(self.root / tag, ignore_errors=True)


class Checkpointer:
    """A rank's side of saving and resuming: every rank writes its shard into the staging folder,
    rank 0 publishes it once all have (barriers between), and the hang rule is told a save is on."""

    def __init__(self, store: CheckpointStore, engine, dist, rank: int, progress, log, frozen_excluded: bool):
        self.store, self.engine, self.dist, self.rank = store, engine, dist, rank
        self.progress, self.log, self.frozen_excluded = progress, log, frozen_excluded
        self.last_save = time.monotonic()
        self.seconds, self.written = 0.0, 0

    def resume(self) -> int:
        """Load the newest checkpoint that verifies; the step it holds (0: none, a fresh start)."""
        tag = self.store.choose(lambda message: self.log(f"warning: {message}"))
        if tag:
            self.engine.load_checkpoint(str(self.store.root), tag=tag, load_module_strict=False)
            self.log(f"resumed from checkpoint {tag}")
        self.last_save = time.monotonic()  # the time cadence counts from the start of training
        return step_of(tag) if tag else 0

    def since_last_save(self) -> float:
        return time.monotonic() - self.last_save

    def save(self, step: int) -> None:
        started = time.monotonic()
        self.progress.report("save", step)
        if self.rank == 0:
            self.store.prepare()
        self.dist.barrier()
        self.engine.save_checkpoint(str(self.store.staging), tag=tag_for(step), save_latest=False,
                                    exclude_frozen_parameters=self.frozen_excluded)
        self.dist.barrier()
        if self.rank == 0:
            self.store.publish(step)
        self.dist.barrier()
        self.last_save = time.monotonic()
        self.progress.report("step", step)  # the save is over: the hang rule's step clock again, from now
        self.seconds += self.last_save - started
        self.written += 1
        self.log(f"checkpoint step {step} saved in {self.last_save - started:.2f} s")
