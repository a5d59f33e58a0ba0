"""Who pushed each model in the site's object store, and which manifest: one record per model,
<shared root>/model-store/<entry>.json, that no other user can change.

Why: on a site where every user's jobs share one instance role, anyone can overwrite any object in
the models bucket, so the store alone cannot say a model is the one that was pushed. The record can:
the folder is sticky (as /tmp: nobody renames or deletes another's file in it) and made by root (the
ft_profile role) or the user who owns the shared root, and the record holds the sha256 of the
manifest `ft model push` uploaded, which names every file's sha256. A reader takes a model only when
the manifest it fetches is the one its record names, and the record is an admin's (root's) or the
reader's own: a record of another user's proves only that they pushed something, and with one
shared identity they could push anything under a name a colleague will use. The first pusher of a
name owns it: a later push of the same name by someone else is refused (an admin, as root, may
replace it).

    {"model": entry, "manifest_sha256": hex, "pushed_by": login, "pushed_at": unix time}
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
import time
from pathlib import Path

from toolkit.base.errors import FtError
from toolkit.base.shared_dirs import (
    SharedFolderError,
    common_dir,
    require_trusted,
    shared_root_path,
    trusted_owners,
    user_name,
)

RECORDS = "model-store"
MAX_RECORD_BYTES = 4096


def manifest_sha256(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def records_dir(shared_root: str) -> Path:
    return shared_root_path(shared_root) / RECORDS


def record_path(shared_root: str, entry: str) -> Path:
    return records_dir(shared_root) / f"{entry}.json"


def read_record(path: Path) -> tuple[dict, int] | None:
    """The record and its owner's uid; None where there is none. ValueError for a damaged one."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a link is another's record
        with os.fdopen(descriptor, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise OSError("not a regular file")
            owner = info.st_uid
            raw = json.loads(handle.read(MAX_RECORD_BYTES + 1))
    except FileNotFoundError:
        return None
    except (OSError, RecursionError) as exc:
        raise ValueError(f"{path} cannot be read ({exc})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("manifest_sha256"), str) \
            or raw.get("model") != path.name.removesuffix(".json"):
        raise ValueError(f"{path} is not the record of model {path.name.removesuffix('.json')}")
    return raw, owner


def check(shared_root: str, entry: str, raw_manifest: bytes) -> str | None:
    """None when the manifest fetched for `entry` is the one its record names; else why not."""
    path = record_path(shared_root, entry)
    try:
        found = read_record(require_trusted(path.parent) / path.name) if path.parent.exists() else None
    except (SharedFolderError, ValueError) as exc:
        return f"its record cannot be trusted: {exc}"
    if found is None:
        return (f"nobody pushed it through ft here (no record {path}): push it again with `ft model push`, "
                "which records who pushed which files")
    record, owner = found
    if owner not in trusted_owners():
        return (f"it was pushed by {user_name(owner)}, not by an admin or you: on a site whose jobs share one "
                "object-store identity anyone could have replaced it, so models others pushed are taken from "
                "admins alone (ask the admins to push it, or push your own copy under another name)")
    if record["manifest_sha256"] != manifest_sha256(raw_manifest):
        return (f"its manifest in the store is not the one {user_name(owner)} pushed (changed since, by whoever "
                f"can write the bucket): ask them to push it again")
    return None


def owned_by_someone_else(path: Path) -> str | None:
    """Who else owns the record at `path` (so may alone replace it), or None."""
    try:
        found = read_record(path)
    except ValueError:
        found = ({}, os.lstat(path).st_uid)
    if found is None or found[1] == os.getuid() or os.getuid() == 0:
        return None
    return user_name(found[1])


def claim(shared_root: str, entry: str) -> Path:
    """Before a push: the record's path, refused (FtError, nothing uploaded) where another user pushed
    this name first."""
    path = common_dir(records_dir(shared_root)) / f"{entry}.json"
    owner = owned_by_someone_else(path)
    if owner:
        raise FtError(f"model {entry} was pushed by {owner}: only they (or an admin) may replace it",
                      hint="push under another name (org/name@revision)")
    return path


def write(path: Path, entry: str, raw_manifest: bytes) -> None:
    """After the manifest is uploaded: the record, replaced whole (a temporary file renamed over it;
    in the sticky folder only its owner, or root, may)."""
    from toolkit.base.shared_dirs import login_name

    body = {"model": entry, "manifest_sha256": manifest_sha256(raw_manifest),
            "pushed_by": login_name(os.getuid()) or str(os.getuid()), "pushed_at": time.time()}
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w") as handle:
            os.fchmod(handle.fileno(), 0o644)
            handle.write(json.dumps(body, indent=1) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except PermissionError:
        raise FtError(f"model {entry} was pushed by {owned_by_someone_else(path) or 'another user'} meanwhile: "
                      "its record stays theirs", hint="push under another name") from None
    finally:
        Path(temporary).unlink(missing_ok=True)
