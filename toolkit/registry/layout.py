"""What the adapter registry holds, named once. The same relative paths name the mirror's objects,
under <mirror>/registry/ (toolkit/registry/mirror.py).

    <shared root>/registry/      common (sticky, world-writable), made the way the runs root is
      versions/                  common: every user registers versions here
        <id>/                    one version, its creator's, read-only once in place
          adapter/               the adapter's files as registered: what a LoRA server loads
          version.json           the record: name, base model, run, data digests, eval, every file's sha256
          serving.json           the handoff manifest for a LoRA serving fleet (toolkit/registry/handoff.py)
      names/                     common: one folder per adapter name
        <name>/                  its owner's: the first user who registered an adapter of that name
          log.jsonl              the name's state transitions, appended under .lock (toolkit/registry/states.py)
          promoted.json          the promoted version's handoff, or none: the one file a fleet polls
          .lock

A version id is the sha256 of the adapter's files: `sha256sum` lines ("<sha256>  <name>"), names in
byte order (toolkit/registry/adapter.py). Without a shared root, the registry is ~/ft/registry, private.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

REGISTRY = "registry"
VERSIONS = "versions"
NAMES = "names"
ADAPTER = "adapter"
VERSION_RECORD = "version.json"
SERVING = "serving.json"
LOG = "log.jsonl"
PROMOTED = "promoted.json"
LOCK = ".lock"

ID_PATTERN = re.compile(r"[0-9a-f]{64}")
SHORT_ID = 12  # what tables show; any unique prefix names a version


@dataclass(frozen=True)
class RegistryLayout:
    root: Path

    @property
    def versions(self) -> Path:
        return self.root / VERSIONS

    @property
    def names(self) -> Path:
        return self.root / NAMES

    def version(self, version_id: str) -> Path:
        return self.versions / version_id

    def adapter(self, version_id: str) -> Path:
        return self.version(version_id) / ADAPTER

    def version_record(self, version_id: str) -> Path:
        return self.version(version_id) / VERSION_RECORD

    def serving(self, version_id: str) -> Path:
        return self.version(version_id) / SERVING

    def name(self, name: str) -> Path:
        return self.names / name

    def log(self, name: str) -> Path:
        return self.name(name) / LOG

    def promoted(self, name: str) -> Path:
        return self.name(name) / PROMOTED

    def lock(self, name: str) -> Path:
        return self.name(name) / LOCK

    def relative(self, path: Path) -> str:
        """A path of the registry as the mirror names it: relative, with '/'."""
        return path.relative_to(self.root).as_posix()
