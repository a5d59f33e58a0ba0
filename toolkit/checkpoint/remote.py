"""The object store's tier (S3, reached through toolkit/storage/object_store.py): where a checkpoint
outlives the shared filesystem and the cluster.

A checkpoint is <url>/<tag>/<files> with <url>/<tag>/manifest.json uploaded last: a tag without its
manifest is an upload that never finished and is never taken. A re-upload of a tag removes the old
manifest first. Large files go up as multipart uploads (s3fs, several parts at once); a multipart
upload left unfinished by a killed process is aborted by the next mirror of the same prefix.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolkit.checkpoint import manifest
from toolkit.checkpoint.manifest import MANIFEST, Manifest, is_tag, step_of
from toolkit.checkpoint.seal import Sealer
from toolkit.storage.object_store import parse_s3_url


class RemoteProblem(Exception):
    """A copy in the object store is unusable (missing, partial, corrupt, another lineage)."""


def split_url(url: str) -> tuple[str, str]:
    """s3://bucket/some/prefix -> ('bucket', 'some/prefix')."""
    parsed = parse_s3_url(url, "a checkpoint mirror")
    return parsed.bucket, parsed.key


@dataclass
class RemoteTier:
    url: str
    keep_last: int
    filesystem: Any = field(repr=False)  # the store's (toolkit/storage/object_store.py)
    # Only checkpoints sealed with the user's key are taken, or counted when pruning (None: any).
    sealer: Sealer | None = field(default=None, repr=False)
    lineage: str | None = None  # the run's: a checkpoint counted as the user's is of it

    def __post_init__(self) -> None:
        self.url = self.url.rstrip("/")

    def __str__(self) -> str:
        return f"the object store ({self.url})"

    def _path(self, *parts: str) -> str:
        return "/".join([self.url.removeprefix("s3://"), *parts])

    def _all_tags(self) -> list[str]:
        """Every tag with objects under it, whole or not, newest first. Read from the objects
        themselves: a folder listing may still show a tag whose objects are gone (SeaweedFS keeps
        empty folders)."""
        fs = self.filesystem
        fs.invalidate_cache(self._path())
        root = self._path() + "/"
        names = {key.removeprefix(root).split("/", 1)[0] for key in fs.find(self._path()) if key.startswith(root)}
        return sorted((name for name in names if is_tag(name)), key=step_of, reverse=True)

    def tags(self) -> list[str]:
        """Checkpoints whose manifest is there, newest first."""
        return [tag for tag in self._all_tags() if self.filesystem.exists(self._path(tag, MANIFEST))]

    def manifest(self, tag: str) -> Manifest:
        return read_manifest(self.filesystem, self._path(tag))

    def upload(self, folder: Path, described: Manifest, keep_going=lambda: True) -> None:
        """Upload a published checkpoint: its manifest goes last. Stops between files when
        `keep_going` says so (the upload then has no manifest and is not a checkpoint)."""
        put_folder(self.filesystem, folder, described, self._path(described.tag), keep_going)

    def download(self, tag: str, destination: Path, lineage: str | None) -> Manifest:
        """Fetch a checkpoint into `destination` (a new folder) and verify it against its manifest."""
        if self.manifest(tag).step != step_of(tag):
            raise RemoteProblem(f"{tag}'s manifest is of another step")
        return get_folder(self.filesystem, self._path(tag), destination, lineage, self.sealer)

    def owned(self, tag: str) -> bool:
        """Whether a whole checkpoint here is the user's own, of this tag and this run's lineage (always,
        with no sealer). The step and lineage too: a sealed manifest of theirs copied under newer tags
        would otherwise count as their newest, and have prune remove their real checkpoints."""
        if self.sealer is None:
            return True
        try:
            described = self.manifest(tag)
        except RemoteProblem:
            return False
        return (described.step == step_of(tag) and (not self.lineage or described.lineage == self.lineage)
                and self.sealer.problem(described) is None)

    def prune(self) -> None:
        """Keep the newest keep_last checkpoints; remove older ones, manifest first (so a reader
        never takes a checkpoint whose files are going)."""
        fs = self.filesystem
        # Only the user's own count: a planted newer tag must not push their checkpoints out, and
        # what is not theirs is not theirs to remove either.
        listed = self.tags()
        whole = [tag for tag in listed if self.owned(tag)]
        if not whole:
            return
        kept, oldest_kept = set(whole[:self.keep_last]), step_of(whole[:self.keep_last][-1])
        # Older tags go, and partial ones older than what is kept (a newer partial one may be uploading).
        for tag in self._all_tags():
            if tag in kept or step_of(tag) > oldest_kept or (tag in listed and tag not in whole):
                continue
            if tag in whole:
                fs.rm(self._path(tag, MANIFEST))
            fs.rm(self._path(tag), recursive=True)

    def abort_unfinished(self) -> int:
        """Abort the multipart uploads a killed mirror left under this prefix; how many."""
        bucket, prefix = split_url(self.url)
        answer = self.filesystem.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/")
        uploads = answer.get("Uploads", []) or []
        for upload in uploads:
            self.filesystem.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"],
                                    UploadId=upload["UploadId"])
        return len(uploads)


def read_manifest(fs, base: str, vouch: Callable[[bytes], str | None] | None = None) -> Manifest:
    """The manifest of the folder at `base` (bucket/key prefix); RemoteProblem when it is not whole,
    or when `vouch` says why its bytes are not to be trusted (the model store's record)."""
    try:
        raw = fs.cat_file(f"{base}/{MANIFEST}")
    except FileNotFoundError:
        raise RemoteProblem(f"{base} has no manifest (its upload never finished)") from None
    trouble = vouch(raw) if vouch else None
    if trouble:
        raise RemoteProblem(trouble)
    try:
        return Manifest.from_json(raw)
    except ValueError as exc:
        raise RemoteProblem(f"{base}'s manifest is unusable: {exc}") from None


def put_folder(fs, folder: Path, described: Manifest, base: str, keep_going=lambda: True) -> None:
    """Upload the files a manifest names, then the manifest: until it is there, the folder is not
    whole to any reader (a folder uploaded before loses its manifest first)."""
    with contextlib.suppress(FileNotFoundError):
        fs.rm(f"{base}/{MANIFEST}")
    for name in sorted(described.files):
        if not keep_going():
            raise InterruptedError(f"the upload to {base} was abandoned")
        fs.put_file(str(folder / name), f"{base}/{name}")
    fs.pipe_file(f"{base}/{MANIFEST}", described.to_json().encode())


def get_folder(fs, base: str, destination: Path, lineage: str | None = None,
               sealer: Sealer | None = None, vouch: Callable[[bytes], str | None] | None = None) -> Manifest:
    """Download the folder at `base` into `destination` (a new folder), verified file by file
    against its manifest (and, with a sealer, the manifest against its seal, before any file is
    fetched); on any problem nothing of it is left and RemoteProblem says what."""
    described = read_manifest(fs, base, vouch)
    trouble = manifest.lineage_problem(described, lineage) or (sealer.problem(described) if sealer else None)
    if trouble:
        raise RemoteProblem(trouble)
    destination.mkdir(parents=True)
    try:
        for name in described.files:
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                fs.get_file(f"{base}/{name}", str(target))
            except FileNotFoundError:
                raise RemoteProblem(f"{base}/{name} is missing") from None
            except (IsADirectoryError, NotADirectoryError, FileExistsError) as exc:  # 'a' and 'a/b' both named
                raise RemoteProblem(f"{base}'s manifest names clashing paths ({exc})") from None
        trouble = manifest.problem(destination, described)
        if trouble:
            raise RemoteProblem(trouble)
    except BaseException:
        shutil.rmtree(destination, ignore_errors=True)
        raise
    (destination / MANIFEST).write_text(described.to_json())
    return described


def user_prefix(s3_prefix: str) -> str:
    """The user's own place under the cluster's s3_prefix: <prefix>/users/<login>. A site with
    per-user credentials scopes each to it (the lab does); on one with a shared role, seals keep
    users' checkpoints apart (toolkit/checkpoint/seal.py)."""
    import os

    from toolkit.base.shared_dirs import login_name

    return f"{s3_prefix.rstrip('/')}/users/{login_name(os.getuid()) or f'uid-{os.getuid()}'}"


def mirror_url(explicit: str | None, s3_prefix: str, run_id: str) -> str | None:
    """Where a run's checkpoints are mirrored: the recipe's checkpoint.s3_mirror as written (every run
    of the recipe shares it, so a resubmission anywhere continues from it), else under the user's own
    place in the cluster's s3_prefix, with the run's id (a run of its own), else nowhere."""
    if explicit:
        return explicit.rstrip("/")
    if s3_prefix:
        return f"{user_prefix(s3_prefix)}/runs/{run_id}/checkpoints"
    return None
