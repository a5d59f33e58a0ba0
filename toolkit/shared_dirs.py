"""Folders on the cluster's shared filesystem, which every user of the cluster can reach. Two kinds:

- common folders (the runs root, cache/): every user makes entries in them. Made sticky and
  world-writable, as /tmp is, so no user can rename or delete another's entry.
- private folders (a user's cache, a user's idempotency keys): one user's alone, mode 0700. One
  found owned by somebody else, or writable by others, is never used: another user made it (its
  name is predictable) to plant files that ft would read, or run, in this user's jobs.

Folders others fill (the site's model cache) are read only when owned by this user, by root or by
the owner of the shared root (a site's service account), and not writable by every user.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import stat
from pathlib import Path

from toolkit.errors import FtError

COMMON_MODE = 0o1777


class SharedFolderError(FtError):
    """A folder on the shared filesystem that ft may not use for this user."""


def shared_root_path(shared_root: str) -> Path:
    return Path(shared_root or "~/ft").expanduser()


def common_dir(path: Path) -> Path:
    """A folder every user makes entries in, created sticky and world-writable when missing."""
    try:
        path.mkdir(parents=True)
    except FileExistsError:
        return path
    except OSError as exc:
        raise SharedFolderError(f"cannot create {path}: {exc.strerror or exc}",
                                hint=f"ask the cluster's admins to create it with `mkdir -m 1777 {path}`") from None
    path.chmod(COMMON_MODE)  # mkdir's mode is cut by the umask; chmod's is not
    return path


def private_dir(path: Path) -> Path:
    """A folder of this user's alone: made 0700, or found owned by this user and writable by nobody
    else. A symlink in its place is refused too (it would lead the user's files elsewhere)."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise SharedFolderError(f"cannot create {path}: {exc.strerror or exc}",
                                hint=f"check that you may write to {path.parent}") from None
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise SharedFolderError(f"{path} is not a folder", hint=f"remove it; ft makes {path} itself")
    if info.st_uid != os.getuid():
        raise SharedFolderError(
            f"{path} belongs to {user_name(info.st_uid)}, not to you: ft keeps your files there, so another user "
            "made it to put files in your runs", hint=f"ask the cluster's admins to remove {path}")
    if info.st_mode & 0o022:
        raise SharedFolderError(f"{path} may be written by other users (mode {stat.filemode(info.st_mode)})",
                                hint=f"run `chmod go-w {path}` (or remove it: ft makes it again)")
    return path


def user_cache(shared_root: str) -> Path:
    """This user's cache on the shared filesystem (tokenized data, compiled ops, the tiny model)."""
    return private_dir(common_dir(shared_root_path(shared_root) / "cache") / f"uid-{os.getuid()}")


def trusted_owner_dir(folder: Path, shared_root: str) -> bool:
    """Whether a folder that others fill may be read: owned by this user, root or the owner of the
    shared root, and not writable by every user. A folder that is not there is trusted (nothing to
    read in it yet)."""
    try:
        info = folder.stat()
    except OSError:
        return True
    trusted = {os.getuid(), 0}
    with contextlib.suppress(OSError):
        trusted.add(shared_root_path(shared_root).stat().st_uid)
    return info.st_uid in trusted and not info.st_mode & 0o002


def user_name(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
