"""Folders on the cluster's shared filesystem, which every user of the cluster can reach. Two kinds:

- common folders (the runs root, cache/): every user makes entries in them. Sticky and
  world-writable, as /tmp is, so no user can rename or delete another's entry; and owned by root
  (or by the user, where ft made them), since the owner of a folder may rename anything in it.
- private folders (a user's cache, a user's idempotency keys): one user's alone, mode 0700. One
  found owned by somebody else, or writable by others, is never used: another user made it (its
  name is predictable) to plant files that ft would read, or run, in this user's jobs.

A folder is trusted only when every folder from the shared root down to it is: a real folder (not
a symlink), owned by root or this user, and writable by others only when sticky. ft never creates
the shared root itself: that is the admins' (`ft lab up` makes the lab's). Without a shared root
(`~/ft`), everything is private. Folders others fill (the site's model cache) are read only when
trusted the same way.
"""

from __future__ import annotations

import os
import pwd
import stat
import sys
import tempfile
from pathlib import Path

from toolkit.base.errors import FtError

COMMON_MODE = 0o1777


class SharedFolderError(FtError):
    """A folder on the shared filesystem that ft may not use for this user."""


def shared_root_path(shared_root: str) -> Path:
    return Path(shared_root or "~/ft").expanduser()


def trusted_owners() -> set[int]:
    return {0, os.getuid()}


def folder_problem(path: Path) -> str | None:
    """Why a folder others might reach is not to be trusted, or None."""
    try:
        info = os.lstat(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if stat.S_ISLNK(info.st_mode):
        return "is a symlink (it could lead anywhere)"
    if not stat.S_ISDIR(info.st_mode):
        return "is not a folder"
    if info.st_uid not in trusted_owners():
        return f"belongs to {user_name(info.st_uid)}, who could rename or replace what is in it"
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        return f"may be written by other users and is not sticky (mode {stat.filemode(info.st_mode)})"
    return None


def require_trusted(path: Path) -> Path:
    problem = folder_problem(path)
    if problem:
        raise SharedFolderError(f"{path} {problem}",
                                hint=f"ask the cluster's admins to make it root's: `mkdir -m 1777 {path}` as root")
    return path


def common_dir(path: Path) -> Path:
    """A folder every user makes entries in: made sticky and world-writable when missing, and
    trusted (owner, symlink, mode) when found. Its parent must already be there, and trusted."""
    require_trusted(path.parent)
    try:
        os.mkdir(path)
    except FileExistsError:
        return require_trusted(path)
    except OSError as exc:
        raise SharedFolderError(f"cannot create {path}: {exc.strerror or exc}",
                                hint=f"ask the cluster's admins to create it: `mkdir -m 1777 {path}` as root") from None
    # chmod through the folder just made, never through a name someone could swap for a symlink.
    descriptor = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        if os.fstat(descriptor).st_uid != os.getuid():
            raise SharedFolderError(f"{path} was replaced while ft made it", hint="try again; tell the admins")
        os.fchmod(descriptor, COMMON_MODE)  # mkdir's mode is cut by the umask; chmod's is not
    finally:
        os.close(descriptor)
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
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        what = "a symlink" if stat.S_ISLNK(info.st_mode) else "not a folder" if not stat.S_ISDIR(info.st_mode) \
            else "a folder"
        raise SharedFolderError(
            f"{path} is {what} of {user_name(info.st_uid)}, not yours: ft keeps your files there, so another user "
            "made it to put files in your runs", hint=f"ask the cluster's admins to remove {path}")
    if info.st_mode & 0o022:
        raise SharedFolderError(f"{path} may be written by other users (mode {stat.filemode(info.st_mode)})",
                                hint=f"run `chmod go-w {path}` (or remove it: ft makes it again)")
    return path


def unusable_root(root: Path) -> str | None:
    """Why a shared root cannot hold this user's runs (missing, untrusted, not writable), or None.
    Writability is tried with a file, not read off the mode bits (ACLs, root squash, read-only mounts)."""
    if not root.is_dir():
        return "does not exist"
    problem = folder_problem(root)
    if problem:
        return problem
    try:
        with tempfile.NamedTemporaryFile(dir=root, prefix=".ft-check-"):
            pass
    except OSError as exc:
        return f"is not writable by you ({exc.strerror or exc})"
    return None


def user_cache(shared_root: str) -> Path:
    """This user's cache (tokenized data, compiled ops, the tiny model): <shared root>/cache/uid-N
    on a shared filesystem; ~/ft/cache, private, without one."""
    return user_place(shared_root, "cache")


def user_keys(shared_root: str) -> Path:
    """This user's keys (the checkpoint seal): <shared root>/keys/uid-N, or ~/ft/keys; never a cache
    (clearing one must not turn the user's own checkpoints into foreign ones)."""
    return user_place(shared_root, "keys")


def user_place(shared_root: str, name: str) -> Path:
    """This user's private folder `name` on the shared root, which the login node and every compute
    node see; ~/ft/<name> where the cluster has none."""
    if not shared_root:
        return private_dir(private_dir(shared_root_path("")) / name)
    root = shared_root_path(shared_root)
    if not root.is_dir():
        raise SharedFolderError(f"the shared root {root} does not exist",
                                hint="ask the cluster's admins to create it (`ft lab up` makes the lab's), or fix "
                                     "shared_root in the cluster profile")
    return user_folder(require_trusted(root), name)


_said: set[Path] = set()


def user_folder(root: Path, name: str) -> Path:
    """This user's folder <root>/<name>/uid-N in the common folder <name>; where another user made
    <name> first (on a site whose admins did not: the first user of ft owns it, or someone took the
    name to block everyone), <root>/.<name>-uid-N instead, said once: one user's folder never
    decides for the others. Private either way (a folder of someone else's there is refused)."""
    try:
        return private_dir(common_dir(root / name) / f"uid-{os.getuid()}")
    except SharedFolderError as exc:
        if folder_problem(root / name) is None:  # the common folder is fine: the problem is this user's own
            raise
        fallback = root / f".{name}-uid-{os.getuid()}"
        if fallback not in _said:
            _said.add(fallback)
            print(f"warning: {exc.message}: using {fallback} instead (ask the cluster's admins for a common one: "
                  f"`mkdir -m 1777 {root / name}` as root, once it is removed)", file=sys.stderr)
        return private_dir(fallback)


def trusted_owner_dir(folder: Path) -> bool:
    """Whether a folder that others fill (a model cache tier) may be read: a real folder, owned by
    root or this user, not writable by every user, and readable. One that is not there is trusted
    (there is nothing in it to read)."""
    try:
        info = os.lstat(folder)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return (stat.S_ISDIR(info.st_mode) and info.st_uid in trusted_owners() and not info.st_mode & 0o002
            and os.access(folder, os.R_OK | os.X_OK))


def login_name(uid: int) -> str | None:
    """The account's name, None for a uid no account has."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def user_name(uid: int) -> str:
    """A uid as a message names it."""
    name = login_name(uid)
    return f"user {name} (uid {uid})" if name else f"uid {uid}"


def open_regular(path: Path, text: bool = False):
    """A run's file opened for reading only if it is a regular one: a FIFO left in its place would
    block every reader (ft status, ft report, the scrape) for good, a device would never end."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise OSError(f"{path} is not a regular file")
        return os.fdopen(descriptor, "r", errors="replace") if text else os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def flock_within(descriptor: int, path: Path, wait_s: float, pause: float = 0.05) -> None:
    """An exclusive flock (across processes and nodes, on the shared filesystem), waited for at most
    `wait_s` seconds: TimeoutError after, so that a stuck holder never holds a job or a command for good."""
    import fcntl
    import time

    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} stayed locked for {wait_s:.0f} s") from None
            time.sleep(pause)


def write_atomically(path: Path, text: str, mode: int = 0o600) -> None:
    """Write a file so that readers see the old or the new content, never a half-written one. The
    mode is set explicitly, whatever the umask: ft's files are private to their owner by default."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w") as handle:
            os.fchmod(handle.fileno(), mode)
            handle.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_output(path: Path, text: str, mode: int = 0o600) -> None:
    """What a user's -o names: a device, a FIFO or /dev/stdout is written to, never replaced (as
    root, a rename over /dev/null puts a file in its place); a link's file is written through it;
    anything else atomically."""
    try:
        if path.exists() and not path.is_file():
            with open(path, "w") as out:
                out.write(text)
            return
        write_atomically(path.resolve(), text, mode)
    except OSError as exc:  # /dev/full, a folder under /proc, a read-only or missing folder
        raise FtError(f"cannot write {path}: {exc.strerror or exc}",
                      hint="name a file in a folder you may write (e.g. -o ./job.sbatch)") from None
