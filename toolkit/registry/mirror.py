"""The registry's copy in the object store: <s3_prefix>/registry/, the same paths as on the shared
filesystem (toolkit/registry/layout.py), reached through toolkit/storage/object_store.py as checkpoints
are (the endpoint from AWS_ENDPOINT_URL, else the profile's s3_endpoint; credentials from the environment).

The shared filesystem is the truth: the mirror is written after it, and a failed upload loses nothing
there (`ft adapters sync` uploads what is missing, and repairs what was changed in the store: every
user's jobs may write the registry's prefix, so its copy is checked against the registry, never
trusted). A version goes up files first and version.json last: a version in the mirror is whole once
its record is there. Each file is checked against the record as it goes up, and on each sync as it
is read back. A name's log and promoted.json go up whenever they differ from the mirror's.
"""

from __future__ import annotations

from pathlib import Path

from toolkit.base.digests import sha256_stream
from toolkit.base.shared_dirs import open_regular
from toolkit.registry.adapter import digest_of, read_bounded
from toolkit.registry.layout import ADAPTER, RegistryLayout
from toolkit.registry.records import FileDigest, VersionRecord
from toolkit.registry.states import MAX_LOG_BYTES

MAX_RECORD_BYTES = 4 << 20  # version.json (the evaluation's result is at most 256 KiB) and serving.json


class MirrorProblem(Exception):
    """A version that cannot go up as it is (its files no longer match its record)."""


class RegistryMirror:
    def __init__(self, url: str, endpoint: str = "", filesystem=None):
        self.url = url.rstrip("/")
        self.endpoint = endpoint
        self._filesystem = filesystem

    @classmethod
    def for_prefix(cls, s3_prefix: str, endpoint: str = "") -> RegistryMirror | None:
        """The registry's mirror under the cluster's s3_prefix (the checkpoints' too); None without one."""
        return cls(f"{s3_prefix.rstrip('/')}/registry", endpoint) if s3_prefix else None

    def __str__(self) -> str:
        return self.url

    @property
    def filesystem(self):
        """Made on first use: `ft adapters ls` never imports s3fs."""
        if self._filesystem is None:
            from toolkit.storage.object_store import ObjectStore

            options = {"auto_mkdir": True} if self.url.startswith("file://") else {}
            self._filesystem = ObjectStore(self.endpoint).filesystem(self.url, **options)[0]
        return self._filesystem

    def uri(self, relative: str) -> str:
        return f"{self.url}/{relative}"

    def _key(self, relative: str) -> str:
        return f"{self.filesystem._strip_protocol(self.url)}/{relative}"

    def push_version(self, layout: RegistryLayout, record: VersionRecord) -> bool:
        """Upload a version unless the mirror has it whole and as registered; True when it went up now
        (a version whose copy was changed in the store, by whoever can write it, goes up again: its
        record first removed, so no reader takes it half-repaired). A file of it missing or unreadable
        here is a MirrorProblem of this version alone."""
        done = self._key(layout.relative(layout.version_record(record.id)))
        if self.filesystem.exists(done):
            if self.matches(layout, record):
                return False
            self.filesystem.rm(done)  # first: no reader takes the version while it is repaired
            self.filesystem.rm(self._key(layout.relative(layout.version(record.id))), recursive=True)
        for path in [*(layout.adapter(record.id) / name for name in record.files), layout.serving(record.id),
                     layout.version_record(record.id)]:
            try:
                with open_regular(path):
                    pass
            except OSError as exc:
                raise MirrorProblem(f"{path} cannot be read here ({exc.strerror or exc}): the version is not "
                                    "mirrored") from None
        for name, digest in sorted(record.files.items()):
            self._put(layout, layout.adapter(record.id) / name, digest)
        self._put(layout, layout.serving(record.id))
        self._put(layout, layout.version_record(record.id))
        return True

    def matches(self, layout: RegistryLayout, record: VersionRecord) -> bool:
        """Whether the mirror's copy of a version is the registered one: its records byte for byte,
        the adapter's files exactly the recorded ones, each by size and sha256 (read back whole:
        adapters are small, and a changed file of the same size is found only so)."""
        for path in (layout.version_record(record.id), layout.serving(record.id)):
            try:
                if self.filesystem.cat_file(self._key(layout.relative(path))) != read_bounded(path, MAX_RECORD_BYTES):
                    return False
            except FileNotFoundError:
                return False
        folder = self._key(layout.relative(layout.version(record.id)))
        self.filesystem.invalidate_cache(folder)
        found = self.filesystem.find(folder, detail=True)
        listed = {key.removeprefix(folder + "/"): info for key, info in found.items()}
        expected_names = {f"{ADAPTER}/{name}" for name in record.files} | {
            layout.version_record(record.id).name, layout.serving(record.id).name}
        if set(listed) != expected_names:  # a file added in the version (a server would read it too)
            return False
        for name, expected in record.files.items():
            if listed[f"{ADAPTER}/{name}"].get("size") != expected.bytes:
                return False
            try:
                with self.filesystem.open(self._key(layout.relative(layout.adapter(record.id) / name)), "rb") as remote:
                    if sha256_stream(remote) != (expected.bytes, expected.sha256):
                        return False
            except FileNotFoundError:
                return False
        return True

    def _put(self, layout: RegistryLayout, path: Path, expected: FileDigest | None = None) -> None:
        key = self._key(layout.relative(path))
        if expected is None:
            self.filesystem.pipe_file(key, read_bounded(path, MAX_RECORD_BYTES))
            return
        with self.filesystem.open(key, "wb") as remote:
            sent = digest_of(path, remote.write)
        if sent != expected:
            raise MirrorProblem(f"{path} is not the file registered (sha256 {sent.sha256[:12]}, recorded "
                                f"{expected.sha256[:12]}): the version is not mirrored")

    def push_name(self, layout: RegistryLayout, name: str) -> bool:
        """Upload a name's log, then its promoted.json, where the mirror's differ; True when any went up."""
        changed = False
        for path in (layout.log(name), layout.promoted(name)):
            if not path.exists():
                continue
            local, key = read_bounded(path, MAX_LOG_BYTES), self._key(layout.relative(path))
            try:
                remote = self.filesystem.cat_file(key)
            except FileNotFoundError:
                remote = None
            if remote != local:
                self.filesystem.pipe_file(key, local)
                changed = True
        return changed
