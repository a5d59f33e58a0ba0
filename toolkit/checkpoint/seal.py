"""Checkpoints a run can prove are its owner's: each manifest carries an HMAC (its `seal`) under the
user's checkpoint key, and a checkpoint is resumed from only when its seal verifies.

Why: object storage is shared. On a site where every user's jobs hold one instance role (or the same
S3 key), anyone may write under anyone's mirror prefix; a checkpoint planted there with a newer step
would be the one a resume takes. S3's permissions cannot be relied on, so the checkpoint proves
itself. The key is the user's, not the run's: every run of a recipe with an explicit
checkpoint.s3_mirror continues from that mirror, and a resubmission is another run.

The key is <shared root>/keys/uid-N/checkpoint-seal.key (32 random bytes, 0600 in the user's private
folder on the shared filesystem: the login node and every compute node read the same one, whichever
runs folder a run is in). It is made by whichever process needs it first, linked into place whole
(two made at once: one wins, both use it). To continue a mirror on another cluster, copy the key to
the same place there.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from toolkit.base.shared_dirs import open_regular, user_keys
from toolkit.checkpoint.manifest import Manifest

KEY_NAME = "checkpoint-seal.key"
KEY_BYTES = 32
CONTEXT = b"ft-checkpoint-seal-v1\n"


def key_path(shared_root: str) -> Path:
    """This user's key on the cluster whose shared root this is."""
    return user_keys(shared_root) / KEY_NAME


def load_or_make_key(path: Path) -> bytes:
    """The key at `path`, made first where there is none. OSError or ValueError when it is unusable
    (never replaced: checkpoints sealed with it would all become foreign)."""
    try:
        return read_key(path)
    except FileNotFoundError:
        pass
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # 0600
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(secrets.token_bytes(KEY_BYTES))
            handle.flush()
            os.fsync(handle.fileno())
        with contextlib.suppress(FileExistsError):  # another process made it a moment ago: theirs is the key
            os.link(temporary, path)
    finally:
        os.unlink(temporary)
    return read_key(path)


def read_key(path: Path) -> bytes:
    with open_regular(path) as handle:
        if os.fstat(handle.fileno()).st_uid != os.getuid():
            raise ValueError(f"{path} is not yours: ask the cluster's admins to remove it")
        key = handle.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise ValueError(f"{path} is not a checkpoint key ({len(key)} bytes, not {KEY_BYTES})")
    return key


@dataclass(frozen=True)
class Sealer:
    """Seals manifests with the user's key, for one place (`scope`: the run's mirror), and says why
    one is not theirs there."""
    key: bytes
    where: str = "your checkpoint key"  # said in refusals: the key's path
    # The mirror the seal is for: a sealed manifest of the user's copied from another run's mirror
    # into this one is not of this one (prune would count it, a resume would take another run's state).
    scope: str = ""

    @classmethod
    def for_shared_root(cls, shared_root: str, scope: str = "") -> Sealer:
        path = key_path(shared_root)
        return cls(load_or_make_key(path), str(path), scope)

    def mac(self, described: Manifest) -> str:
        sealed = CONTEXT + self.scope.encode() + b"\n" + described.signed_bytes()
        return hmac.new(self.key, sealed, hashlib.sha256).hexdigest()

    def sealed(self, described: Manifest) -> Manifest:
        return replace(described, seal=self.mac(described))

    def problem(self, described: Manifest) -> str | None:
        """None when the manifest is sealed with this key; else why it is not the user's."""
        if not described.lineage:
            return "its manifest names no lineage (no checkpoint ft writes now lacks one)"
        if not described.seal:
            return (f"its manifest is not sealed: ft seals every checkpoint with {self.where}, so this one was "
                    "not written by a run of yours (or by an ft older than seals)")
        if not hmac.compare_digest(described.seal, self.mac(described)):
            return (f"its seal is not made with {self.where} for {self.scope or 'this run'}: another user's upload, "
                    "a manifest changed after it was written, one of yours copied from another mirror, or a "
                    "checkpoint of yours from another cluster (copy the key there)")
        return None
