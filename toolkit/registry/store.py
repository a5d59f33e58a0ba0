"""The adapter registry: immutable versions of LoRA adapters, addressed by the hash of their files, and
the state of each (toolkit/registry/states.py). Layout: toolkit/registry/layout.py.

Who may do what, by the filesystem's word (never by what a file claims):
- anyone may register a version; its folder is theirs (the creator), read-only once in place, and a
  version.json whose creator is not the folder's owner is not a version;
- an adapter name is its owner's: the user who first registered an adapter of that name (their
  folder under names/ holds the name's log). Only the name's owner, or root, promotes or deprecates
  its versions: another user's version of that name stays a draft until the owner promotes it, and
  nobody else can supersede what a name serves. A name taken by the wrong user is freed by the
  admins (root removes names/<name>/).

A version is promoted only when its evaluation passed, every gate included (records.promotion_problem),
and its files are still those registered; never once deprecated. Promoting a version deprecates the
one its name served, in the same locked write.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache, partial
from pathlib import Path

from pydantic import ValidationError

from toolkit.base.cache_entries import discard, staging_path
from toolkit.base.errors import FtError, UsageError
from toolkit.base.names import NAME_PATTERN
from toolkit.base.shared_dirs import (
    common_dir,
    login_name,
    private_dir,
    require_trusted,
    shared_root_path,
    user_name,
    write_atomically,
)
from toolkit.registry import handoff
from toolkit.registry.adapter import (
    AdapterRefused,
    adapter_files,
    content_id,
    copy_in,
    digest_of,
    lora_shape,
    read_bounded,
)
from toolkit.registry.layout import ADAPTER, ID_PATTERN, REGISTRY, SERVING, SHORT_ID, VERSION_RECORD, RegistryLayout
from toolkit.registry.mirror import MirrorProblem, RegistryMirror
from toolkit.registry.records import MAX_EVAL_BYTES, AdapterRecord, VersionRecord, promotion_problem
from toolkit.registry.states import History, State, Transition, append, locked, read_history
from toolkit.storage.object_store import Answer, within

MIRROR_DEADLINE_S = 600.0  # an upload past it goes on in the background; `ft adapters sync` finishes it
MAX_REASON = 1000
# A version's record: its evaluation (at most MAX_EVAL_BYTES), its files (at most 64) and its shape.
# A larger one is no record ft wrote: listing skips it unread (a hundred planted 4 MiB records took
# `ft adapters ls` 6.6 s).
MAX_VERSION_RECORD_BYTES = MAX_EVAL_BYTES + (128 << 10)  # compact; a record that fits indented is indented


class RegistryError(FtError):
    """A version or a name the registry cannot use, or a move it refuses: nothing was changed."""

    exit_code = 2


class PromotionRefused(RegistryError):
    pass


@dataclass(frozen=True)
class Version:
    record: VersionRecord
    state: State
    folder: Path

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def short_id(self) -> str:
        return self.record.id[:SHORT_ID]

    @property
    def name(self) -> str:
        return self.record.name

    @property
    def adapter(self) -> Path:
        return self.folder / ADAPTER

    def to_dict(self) -> dict:
        return {**self.record.model_dump(), "state": str(self.state), "folder": str(self.folder),
                "adapter": str(self.adapter), "serving": str(self.folder / SERVING)}


@dataclass(frozen=True)
class Change:
    """A promotion or a deprecation: the version as it is now, and the moves written (none: it was so)."""
    version: Version
    transitions: list[Transition]


@dataclass
class SyncReport:
    versions: list[str] = field(default_factory=list)  # uploaded now
    names: list[str] = field(default_factory=list)  # whose log or promoted.json went up now
    problems: list[str] = field(default_factory=list)


def _user() -> str:
    return login_name(os.getuid()) or f"uid-{os.getuid()}"


class Registry:
    def __init__(self, root: Path, common: bool = False, mirror: RegistryMirror | None = None,
                 warn: Callable[[str], None] = lambda message: None):
        self.layout = RegistryLayout(root)
        self.common = common  # every user of the cluster registers here (the shared root's registry/)
        self.mirror = mirror
        self.warn = warn  # what did not reach the mirror (the shared filesystem has it)

    @classmethod
    def for_shared_root(cls, shared_root: str, mirror: RegistryMirror | None = None,
                        warn: Callable[[str], None] = lambda message: None) -> Registry:
        return cls(shared_root_path(shared_root) / REGISTRY, bool(shared_root), mirror, warn)

    def __str__(self) -> str:
        return str(self.layout.root)

    # -- folders -----------------------------------------------------------------------------
    def _folder(self, path: Path) -> Path:
        """A folder others make entries in: common (sticky) in a shared registry, else private."""
        return common_dir(path) if self.common else private_dir(path)

    def _writable(self) -> RegistryLayout:
        if not self.common:
            private_dir(self.layout.root.parent)
        self._folder(self.layout.root)
        self._folder(self.layout.versions)
        self._folder(self.layout.names)
        return self.layout

    def _trusted(self, *folders: Path) -> bool:
        """Whether the registry's folders are there to read; SharedFolderError for one that is not to be
        trusted (another user's, a symlink): what it holds could be anything."""
        for folder in (self.layout.root, *folders):
            if not os.path.lexists(folder):
                return False
            require_trusted(folder)
        return True

    def name_owner(self, name: str) -> int | None:
        """The uid whose folder holds the name's log; None while nobody registered the name."""
        if not self._trusted(self.layout.names):
            return None
        folder = self.layout.name(name)
        try:
            info = os.lstat(folder)
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(info.st_mode) or info.st_mode & 0o022:
            raise RegistryError(f"{folder} is not a name's folder to trust (a symlink, a file, or writable by "
                                "others, who could replace its log)",
                                hint=f"ask the cluster's admins to remove {folder}")
        return info.st_uid

    def _claim(self, name: str) -> int:
        """The name's owner, the caller when nobody had it."""
        folder = self._writable().name(name)
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
            descriptor = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            try:
                os.fchmod(descriptor, 0o755)  # others read its log; the umask does not decide
            finally:
                os.close(descriptor)
        return self.name_owner(name)

    # -- reading -----------------------------------------------------------------------------
    def history(self, name: str) -> History:
        owner = self.name_owner(name)
        if owner is None:
            return History()
        try:
            return read_history(self.layout.log(name), owner)
        except OSError as exc:
            raise RegistryError(f"the log of {name} cannot be read: {exc}",
                                hint=f"ask its owner ({user_name(owner)}) or the cluster's admins") from None

    def _load(self, version_id: str, history: Callable[[str], History] | None = None) -> Version:
        """A version as the filesystem vouches for it: its folder, and a record naming that folder's
        id and owner."""
        folder = self.layout.version(version_id)
        try:
            info = os.lstat(folder)
            if not stat.S_ISDIR(info.st_mode) or info.st_mode & 0o022:
                raise OSError("not a folder of its creator's alone")
            record = VersionRecord.model_validate_json(read_bounded(self.layout.version_record(version_id),
                                                                    MAX_VERSION_RECORD_BYTES))
        except FileNotFoundError:
            raise RegistryError(f"no version {version_id[:SHORT_ID]} in {self}", hint="see `ft adapters ls`") from None
        except (OSError, ValidationError, ValueError) as exc:
            why = str(exc).splitlines()[0]
            raise RegistryError(f"{folder} is not a usable version ({why})",
                                hint="ask its creator or the cluster's admins to remove it") from None
        if record.id != version_id or record.creator_uid != info.st_uid:
            raise RegistryError(f"{folder} is not a usable version: its record names another id or creator "
                                f"than its folder's ({user_name(info.st_uid)})",
                                hint="ask the cluster's admins to remove it")
        return Version(record, (history or self.history)(record.name).state(version_id), folder)

    def _ids(self) -> list[str]:
        if not self._trusted(self.layout.versions):
            return []
        return sorted(name for name in os.listdir(self.layout.versions) if ID_PATTERN.fullmatch(name))

    def versions(self, name: str | None = None, state: State | None = None) -> list[Version]:
        """Every usable version, newest first (a damaged or forged one is left out: `show` says why)."""
        history = cache(self.history)
        found = []
        for version_id in self._ids():
            with contextlib.suppress(RegistryError):
                version = self._load(version_id, history)
                if (name is None or version.name == name) and (state is None or version.state == state):
                    found.append(version)
        return sorted(found, key=lambda version: version.record.created, reverse=True)

    def version(self, prefix: str) -> Version:
        """The version a unique prefix of its id names."""
        wanted = prefix.strip().lower()
        if not re.fullmatch(r"[0-9a-f]{1,64}", wanted):
            raise UsageError(f"{prefix!r} is not a version id", hint="ids are hex digits; see `ft adapters ls`")
        matches = [version_id for version_id in self._ids() if version_id.startswith(wanted)]
        if len(matches) > 1:
            raise UsageError(f"{prefix} names {len(matches)} versions ({', '.join(m[:SHORT_ID] for m in matches[:5])})",
                             hint="give more of the id")
        if not matches:
            raise RegistryError(f"no version {prefix} in {self}", hint="see `ft adapters ls`")
        return self._load(matches[0])

    # -- registering -------------------------------------------------------------------------
    def register(self, adapter_dir: Path, record: AdapterRecord) -> Version:
        """A draft version of the adapter in `adapter_dir` (or the version it already is: the same files
        are one version, whatever the record). Copied in under a staging name and renamed into place
        whole; then mirrored."""
        names = adapter_files(adapter_dir)
        layout = self._writable()
        staging = staging_path(layout.versions / "version", "registering")
        try:
            staging.mkdir(mode=0o700)
            (staging / ADAPTER).mkdir(mode=0o700)
            files = copy_in(adapter_dir, names, staging / ADAPTER)
            shape = lora_shape(staging / ADAPTER)
            version_id = content_id(files)
            if not os.path.lexists(layout.version(version_id)):
                self._claim(record.name)
                self._place(staging, VersionRecord(**record.model_dump(), id=version_id, creator=_user(),
                                                   creator_uid=os.getuid(), created=time.time(), files=files,
                                                   lora=shape))
        except OSError as exc:
            raise RegistryError(f"registering {adapter_dir} in {self} failed: {exc}", hint="nothing was "
                                "registered; check the shared filesystem (space, permissions)") from None
        finally:
            _unseal(staging)
            discard(staging)
        version = self._load(version_id)
        if self.mirror:
            self._mirrored(f"version {version.short_id}", lambda: self.mirror.push_version(self.layout, version.record))
        return version

    def _place(self, staging: Path, record: VersionRecord) -> None:
        """Write the record and the handoff, make it all read-only, and rename it into place: readers see
        a whole version or none. Another process placing the same files first is the same version."""
        final = self.layout.version(record.id)
        s3_uri = self.mirror.uri(self.layout.relative(self.layout.adapter(record.id))) if self.mirror else None
        serving = handoff.serving_manifest(record, self.layout.adapter(record.id), s3_uri)
        text = record.model_dump_json(indent=2) + "\n"
        if len(text.encode()) > MAX_VERSION_RECORD_BYTES:  # indented, an evaluation's numbers take more room
            text = record.model_dump_json() + "\n"
        write_atomically(staging / VERSION_RECORD, text, mode=0o444)
        write_atomically(staging / SERVING, json.dumps(serving, indent=2) + "\n", mode=0o444)
        for folder in (staging / ADAPTER, staging):
            os.chmod(folder, 0o555)
        try:
            os.rename(staging, final)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise

    # -- moving ------------------------------------------------------------------------------
    def promote(self, version_id: str, reason: str = "") -> Change:
        """Promote a version (the one its name serves), deprecating the one promoted before, under the
        name's lock. PromotionRefused for a version whose evaluation or gates failed, whose files changed
        since it was registered, or that was deprecated."""
        version = self.version(version_id)
        problem = promotion_problem(version.record)
        if problem:
            raise PromotionRefused(f"version {version.short_id} of {version.name} is never promoted: {problem}",
                                   hint=f"it stays a draft; `ft adapters show {version.short_id}` shows its evaluation")
        self._unchanged(version)

        def moves(history: History) -> list[Transition]:
            now = history.state(version.id)
            if now == State.deprecated:
                raise PromotionRefused(f"version {version.short_id} of {version.name} was deprecated: it is never "
                                       "promoted again", hint="register a new adapter (a new run) to serve another")
            if now == State.promoted:
                return []
            superseded = [_move(history.promoted, State.promoted, State.deprecated,
                                f"superseded by {version.short_id}")] if history.promoted else []
            return [*superseded, _move(version.id, State.draft, State.promoted, reason)]
        return self._transact(version, moves)

    def deprecate(self, version_id: str, reason: str = "") -> Change:
        """Deprecate a version for good (a promoted one leaves its name serving none)."""
        version = self.version(version_id)

        def moves(history: History) -> list[Transition]:
            now = history.state(version.id)
            return [] if now == State.deprecated else [_move(version.id, now, State.deprecated, reason)]
        return self._transact(version, moves)

    def files_changed(self, version: Version) -> bool:
        """Whether the version's files are no longer those registered (each read and hashed again):
        a serving fleet loads only files whose sha256 is the handoff's."""
        try:
            names = adapter_files(version.adapter)
            if sorted(names) != sorted(version.record.files) or any(
                    os.lstat(version.adapter / name).st_size != version.record.files[name].bytes for name in names):
                return True  # found without reading a byte
            files = {name: digest_of(version.adapter / name) for name in names}
        except (OSError, AdapterRefused):
            return True
        return files != version.record.files or content_id(files) != version.id

    def _unchanged(self, version: Version) -> None:
        if self.files_changed(version):
            raise PromotionRefused(f"version {version.short_id}'s files are not those registered: it is never "
                                   "promoted", hint=f"register the adapter again; ask {version.record.creator} "
                                                    f"or the admins to remove {version.folder}")

    def _transact(self, version: Version, moves: Callable[[History], list[Transition]]) -> Change:
        """Decide and write moves of one name under its lock, with its promoted.json; then mirror them."""
        name = version.name
        owner = self._claim(name)
        if os.getuid() not in (owner, 0):
            raise PromotionRefused(f"adapter name {name} is {user_name(owner)}'s: only they, or root, promote or "
                                   f"deprecate its versions", hint=f"ask them; a name taken in error is freed by the "
                                                                  f"admins (remove {self.layout.name(name)})")
        try:
            with locked(self.layout.lock(name), owner):
                history = read_history(self.layout.log(name), owner)
                written = moves(history)
                for move in written:
                    history.apply(move)
                pointer = self._pointer(name, history)  # read before anything is written
                if written:
                    append(self.layout.log(name), written, owner)
                # Rewritten from the log each time: one a failure left behind is mended by the next move.
                write_atomically(self.layout.promoted(name), pointer, mode=0o644)
        except (OSError, TimeoutError) as exc:
            raise RegistryError(f"the log of {name} could not be written: {exc}",
                                hint="try again: a move is in the log whole or not at all") from None
        if written and self.mirror:
            self._mirrored(f"the log of {name}", lambda: self.mirror.push_name(self.layout, name))
        return Change(self._load(version.id), written)

    def _pointer(self, name: str, history: History) -> str:
        """promoted.json as the history has it. The handoff is made again from the version's record
        (its files' sha256 as registered), never copied from its serving.json: a version folder is its
        creator's, who could point that file anywhere."""
        promoted = history.promoted
        serving = None
        if promoted:
            with contextlib.suppress(RegistryError, OSError):  # a promoted version no longer usable serves none
                record = self._load(promoted).record
                adapter = self.layout.adapter(record.id)
                s3_uri = self.mirror.uri(self.layout.relative(adapter)) if self.mirror else None
                serving = handoff.serving_manifest(record, adapter, s3_uri)
        promotion = next((move for move in reversed(history.transitions)
                          if move.version == promoted and move.to_state == State.promoted), None)
        return json.dumps(handoff.promoted_pointer(name, serving, promotion), indent=2) + "\n"

    # -- the mirror --------------------------------------------------------------------------
    def _mirrored(self, what: str, upload: Callable[[], object]) -> None:
        answer = within(upload, MIRROR_DEADLINE_S)
        if answer.error is not None or not answer.in_time:
            self.warn(f"{what} is not in the mirror {self.mirror} yet ({_why(answer)}); the shared filesystem has "
                      "it, and `ft adapters sync` uploads it")

    def sync(self) -> SyncReport:
        """Upload what the mirror lacks: versions it has not whole, logs and promoted.json that differ. A
        version that cannot go up as it is does not stop the others; a failing store stops them all."""
        if self.mirror is None:
            raise UsageError(f"the registry {self} has no mirror", hint="set s3_prefix in the cluster profile")
        report = SyncReport()
        uploads = [(version.short_id, report.versions, version.id,
                    partial(self.mirror.push_version, self.layout, version.record)) for version in self.versions()]
        uploads += [(name, report.names, name, partial(self.mirror.push_name, self.layout, name))
                    for name in self._names()]
        for index, (label, done, key, upload) in enumerate(uploads):
            answer = within(upload, MIRROR_DEADLINE_S)
            if answer.in_time and answer.error is None:
                if answer.value:
                    done.append(key)
                continue
            report.problems.append(f"{label}: {_why(answer)}")
            # A version that cannot go up as it is (its files changed, or one of them is not readable
            # here) costs only itself; anything else is the store failing.
            if not isinstance(answer.error, MirrorProblem):
                report.problems.append(f"the store is failing: {len(uploads) - index - 1} more left for a later sync")
                break
        return report

    def _names(self) -> list[str]:
        if not self._trusted(self.layout.names):
            return []
        trusted = []
        for name in sorted(os.listdir(self.layout.names)):
            with contextlib.suppress(RegistryError):
                if re.fullmatch(NAME_PATTERN, name) and self.name_owner(name) is not None:
                    trusted.append(name)
        return trusted


def _move(version_id: str, from_state: State, to_state: State, reason: str) -> Transition:
    return Transition(version_id, from_state, to_state, _user(), os.getuid(), time.time(), reason[:MAX_REASON])


def _why(answer: Answer) -> str:
    return f"{type(answer.error).__name__}: {answer.error}" if answer.error else \
        f"no end within {MIRROR_DEADLINE_S:.0f} s"


def _unseal(staging: Path) -> None:
    """A staging folder left (a failure, or the same version placed first) is ours to remove."""
    for folder in (staging, staging / ADAPTER):
        with contextlib.suppress(OSError):
            os.chmod(folder, 0o700)
