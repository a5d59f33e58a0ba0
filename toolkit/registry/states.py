"""A version's state: draft (as registered), promoted (the one a fleet serves under its name), or
deprecated (for good). Moves: draft -> promoted -> deprecated, and draft -> deprecated.

Each adapter name keeps its moves in an append-only log (one JSON line each: version, from, to, user,
uid, time, reason), written only under the name's lock; a version the log does not name is a draft.
A promotion and the deprecation of the version it supersedes are one write under one lock, the
deprecation first: no reader, and no crash between the two, ever sees two versions promoted.

The log is its name's owner's file in its owner's folder (toolkit/registry/store.py says who may
write it). Read bounded, a regular file only; a torn last line (a crash mid-write) and lines that do
not follow from those before are skipped, and said.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path

from toolkit.base.shared_dirs import flock_within
from toolkit.registry.layout import ID_PATTERN

MAX_LOG_BYTES = 16 << 20  # some 50,000 moves
LOCK_WAIT_S = 30.0


class State(StrEnum):
    draft = "draft"
    promoted = "promoted"
    deprecated = "deprecated"


MOVES = {(State.draft, State.promoted), (State.draft, State.deprecated), (State.promoted, State.deprecated)}


@dataclass(frozen=True)
class Transition:
    version: str
    from_state: State
    to_state: State
    user: str
    uid: int
    time: float
    reason: str

    def to_json(self) -> str:
        entry = asdict(self)
        entry["from"], entry["to"] = entry.pop("from_state"), entry.pop("to_state")
        return json.dumps(entry, sort_keys=True)

    @classmethod
    def from_json(cls, line: str) -> Transition:
        """ValueError for anything but a well-formed move."""
        raw = json.loads(line)
        if not isinstance(raw, dict) or set(raw) != {"version", "from", "to", "user", "uid", "time", "reason"}:
            raise ValueError("not a transition")
        move = cls(raw["version"], State(raw["from"]), State(raw["to"]), raw["user"], raw["uid"], raw["time"],
                   raw["reason"])
        if not (isinstance(move.version, str) and ID_PATTERN.fullmatch(move.version) and isinstance(move.user, str)
                and type(move.uid) is int and type(move.time) in (int, float) and isinstance(move.reason, str)):
            raise ValueError("a transition's field has the wrong type")
        return move

    def to_dict(self) -> dict:
        return json.loads(self.to_json())


@dataclass
class History:
    """A name's log, replayed."""
    transitions: list[Transition] = field(default_factory=list)
    states: dict[str, State] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # why each unusable line was left out

    def state(self, version_id: str) -> State:
        return self.states.get(version_id, State.draft)

    @property
    def promoted(self) -> str | None:
        return next((version for version, state in self.states.items() if state == State.promoted), None)

    def apply(self, move: Transition) -> str | None:
        """Take a move in, or say why it does not follow (and leave it out)."""
        now = self.state(move.version)
        if move.from_state != now:
            return f"{move.version[:12]} {move.from_state} -> {move.to_state}, but it was {now}"
        if (move.from_state, move.to_state) not in MOVES:
            return f"{move.version[:12]} {move.from_state} -> {move.to_state} is no move a version makes"
        if move.to_state == State.promoted and self.promoted:
            return f"{move.version[:12]} promoted while {self.promoted[:12]} still was"
        self.states[move.version] = move.to_state
        self.transitions.append(move)
        return None


def replay(text: str) -> History:
    history = History()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            problem = history.apply(Transition.from_json(line))
        except (ValueError, KeyError, TypeError, RecursionError):
            problem = "not a transition (torn or damaged)"
        if problem:
            history.skipped.append(f"line {number}: {problem}")
    return history


def _open_owned(path: Path, flags: int, owner: int) -> int:
    """A log or lock file of the name's owner (or root), opened only when it is a regular file: never
    through a symlink, never a FIFO."""
    descriptor = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode) or info.st_uid not in (owner, 0):
        os.close(descriptor)
        raise OSError(f"{path} is not a regular file of the name's owner")
    if info.st_uid != owner and os.getuid() == 0 and flags & os.O_CREAT:
        os.fchown(descriptor, owner, -1)  # made by root for its owner: theirs to append to afterwards
    return descriptor


def read_history(path: Path, owner: int) -> History:
    try:
        descriptor = _open_owned(path, os.O_RDONLY, owner)
    except FileNotFoundError:
        return History()
    with os.fdopen(descriptor, "rb") as handle:
        if os.fstat(descriptor).st_size > MAX_LOG_BYTES:
            raise OSError(f"{path} is over {MAX_LOG_BYTES >> 20} MiB")
        return replay(handle.read(MAX_LOG_BYTES).decode(errors="replace"))


def append(path: Path, moves: list[Transition], owner: int) -> None:
    """Append moves in one write, on a line of their own (after a torn line, a newline first), synced
    before the lock is let go."""
    descriptor = _open_owned(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, owner)
    try:
        size = os.fstat(descriptor).st_size
        torn = size and os.pread(descriptor, 1, size - 1) != b"\n"
        text = ("\n" if torn else "") + "".join(move.to_json() + "\n" for move in moves)
        data = memoryview(text.encode())
        while data:
            data = data[os.write(descriptor, data):]
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def locked(path: Path, owner: int, wait_s: float = LOCK_WAIT_S):
    """The name's lock, across processes and nodes (flock on the shared filesystem), waited for at most
    `wait_s` (TimeoutError after: a stuck holder never holds a command for good). Opened read-only, so
    the name's owner and root can each take it, whichever made the file."""
    descriptor = _open_owned(path, os.O_RDONLY | os.O_CREAT, owner)
    try:
        flock_within(descriptor, path, wait_s, pause=0.02)
        yield
    finally:
        os.close(descriptor)  # lets the lock go
