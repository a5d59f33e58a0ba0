"""The shared filesystem's tier (Lustre in production): the checkpoint every rank resumes from.

A checkpoint is written under <root>/.staging/<tag>, every rank leaves a mark there when its files
are written, and rank 0 adds the manifest, flushes everything, renames the folder to <root>/<tag> and
moves the `latest` pointer (last, atomically). A crash at any point leaves the previous checkpoints
as they were; what it left in .staging is cleared by the next save.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.base.cache_entries import discard
from toolkit.checkpoint import manifest
from toolkit.checkpoint.manifest import FileEntry, Manifest, is_tag, step_of
from toolkit.checkpoint.seal import Sealer

LATEST = "latest"
STAGING = ".staging"
WRITTEN_MARK = ".written-rank-"


def fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb+") as handle:
                os.fsync(handle.fileno())
    descriptor = os.open(root, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@dataclass(frozen=True)
class Mark:
    files: dict[str, FileEntry]
    failure: str


@dataclass
class SharedTier:
    root: Path
    keep_last: int
    # Tags being uploaded by this process's mirror: not pruned under it (keep_last 1 would otherwise
    # delete each checkpoint before its upload ends, and none would ever reach the store).
    pinned: set[str] = field(default_factory=set)
    # Tags the last look found unusable: a checkpoint brought back from another tier replaces them.
    unusable: list[str] = field(default_factory=list)
    # Seals what is published, and refuses what another user's key sealed (None: no seals).
    sealer: Sealer | None = None

    def __str__(self) -> str:
        return f"the shared filesystem ({self.root})"

    @property
    def staging(self) -> Path:
        return self.root / STAGING

    def staged(self, tag: str) -> Path:
        return self.staging / tag

    def tags(self) -> list[str]:
        """Published checkpoints, newest first."""
        if not self.root.is_dir():
            return []
        return sorted((p.name for p in self.root.iterdir() if is_tag(p.name) and p.is_dir()), key=step_of,
                      reverse=True)

    def latest_pointer(self) -> str | None:
        try:
            return (self.root / LATEST).read_text().strip() or None
        except OSError:
            return None

    def newest_whole(self, lineage: str | None, warn: Callable[[str], None]) -> str | None:
        """The newest checkpoint that verifies."""
        self.unusable = []
        for tag in self.tags():
            trouble = manifest.verify(self.root / tag, lineage, step_of(tag)) or self.seal_problem(tag)
            if trouble is None:
                return tag
            warn(f"checkpoint {tag} on {self} is unusable ({trouble}); trying the one before")
            self.unusable.append(tag)
        return None

    def seal_problem(self, tag: str) -> str | None:
        """Why a verified checkpoint here is not the user's (None: it is). A manifest with no seal is
        taken where the user owns it: this folder is the run's own, and ft before seals wrote it."""
        if self.sealer is None:
            return None
        path = self.root / tag / manifest.MANIFEST
        described = manifest.read(self.root / tag)
        if not described.seal and os.stat(path).st_uid == os.getuid():
            return None
        return self.sealer.problem(described)

    def prepare(self) -> None:
        """Clear what an interrupted save left behind (rank 0, before every save)."""
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir(parents=True, exist_ok=True)

    def mark_written(self, tag: str, rank: int, files: dict[str, FileEntry], failure: str = "") -> None:
        """This rank's files of `tag` are written, with their sizes and hashes (or failed: why)."""
        mark = self.staged(tag) / f"{WRITTEN_MARK}{rank:05d}"
        mark.parent.mkdir(parents=True, exist_ok=True)
        body = {"files": {name: {"bytes": e.bytes, "sha256": e.sha256} for name, e in files.items()},
                "failure": failure}
        with open(mark, "w") as handle:
            json.dump(body, handle)
            handle.flush()
            os.fsync(handle.fileno())

    def written_marks(self, tag: str) -> dict[int, Mark]:
        """The ranks whose part of `tag` is written (or failed), by rank."""
        marks = {}
        for path in self.staged(tag).glob(f"{WRITTEN_MARK}*"):
            try:
                body = json.loads(path.read_text())
                files = {name: FileEntry(int(e["bytes"]), str(e["sha256"])) for name, e in body["files"].items()}
                marks[int(path.name.removeprefix(WRITTEN_MARK))] = Mark(files, str(body.get("failure", "")))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being written: read again on the next look
        return marks

    def publish(self, described: Manifest) -> Manifest:
        """Make a fully written staging checkpoint the latest one (rank 0, once every rank wrote its
        part). The manifest comes from the ranks' marks: nothing is read back to hash it."""
        tag = described.tag
        staged = self.staged(tag)
        for mark in staged.glob(f"{WRITTEN_MARK}*"):
            mark.unlink()
        for name, entry in described.files.items():  # a cheap check that every part is there, whole
            size = (staged / name).stat().st_size
            if size != entry.bytes:
                raise OSError(f"{staged / name} is {size} bytes, its writer wrote {entry.bytes}")
        if self.sealer:
            described = self.sealer.sealed(described)
        (staged / manifest.MANIFEST).write_text(described.to_json())
        fsync_tree(staged)
        self._install(staged, tag)
        return described

    def adopt(self, folder: Path, tag: str) -> None:
        """A verified copy from another tier (downloaded into .staging) becomes a checkpoint here; the
        newer ones found unusable go (else keep-last would count them, and prune the one adopted)."""
        fsync_tree(folder)
        for bad in self.unusable:
            if step_of(bad) > step_of(tag):
                discard(self.root / bad)
        self._install(folder, tag)

    def _install(self, folder: Path, tag: str) -> None:
        final = self.root / tag
        if final.exists():
            shutil.rmtree(final)
        folder.rename(final)
        pointer = self.root / f".{LATEST}.tmp"
        pointer.write_text(tag + "\n")
        with open(pointer, "rb+") as handle:
            os.fsync(handle.fileno())
        if self.tags()[0] == tag:
            pointer.replace(self.root / LATEST)  # the pointer moves last
        else:  # an older checkpoint brought back from another tier: the pointer stays on the newest
            pointer.unlink()
        self.prune(keep=tag)

    def prune(self, keep: str | None = None) -> None:
        """Keep the newest keep_last, the one just installed, and any being uploaded."""
        for tag in self.tags()[self.keep_last:]:
            if tag != keep and tag not in self.pinned:
                shutil.rmtree(self.root / tag, ignore_errors=True)
