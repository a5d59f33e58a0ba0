"""A run's receipt: what it used and made, as hash-linked entries in <run>/receipt.jsonl, signed by
the site's signer (toolkit/services/signer.py) and checked by `ft receipt verify` (verify.py).

Each line is one entry, written as its canonical JSON (sorted keys, no spaces: a line read back must
be byte for byte what canonical() makes of it):

    seq        1, 2, ... in the order appended
    kind       what happened: submit, attempt, checkpoint, adapter, eval, ...
    time       when (Unix time, of the appending host)
    body       what the caller says of it
    artifacts  name -> {path, bytes, sha256} for a file, {path, files: {name: {bytes, sha256}}} for a
               folder (every file inside); the path relative to the run folder where inside it;
               "prunable": true where the file may go later (an older checkpoint's manifest)
    prev       the previous entry's hash (64 zeros for the first)
    hash       sha256 of the entry's canonical JSON without "hash"

Several processes append to one receipt (the login node at submit, the job script, rank 0, the
watchdog): each append is one write under a flock of the run's .receipt.lock, fsynced.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from toolkit.base.digests import sha256_stream
from toolkit.base.shared_dirs import open_regular, write_atomically
from toolkit.receipts.canonical import ReceiptError, canonical
from toolkit.receipts.signing import request_signature
from toolkit.runs.layout import RunLayout
from toolkit.runs.store import locked

GENESIS = "0" * 64
ENTRY_KEYS = {"seq", "kind", "time", "body", "artifacts", "prev", "hash"}
MAX_ENTRY_BYTES = 1 << 20  # a body and a folder's file list; a longer line is no entry of ft's
MAX_RECEIPT_BYTES = 64 << 20  # thousands of entries; a larger file is refused, not read
KIND_PATTERN = re.compile(r"[a-z][a-z0-9_-]{0,39}")
SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")
# The signer asks Slurm (squeue, 10 s at most) before it answers; the seal holds the receipt's lock
# meanwhile, and other appenders wait 30 s for it at most.
SEAL_TIMEOUT_S = 20.0


@dataclass(frozen=True)
class Digest:
    """A file whose size and sha256 are already known (a data file the data checks hashed): recorded
    as given, not read again."""
    path: Path
    bytes: int
    sha256: str


def entry_hash(entry: Mapping) -> str:
    return hashlib.sha256(canonical({key: value for key, value in entry.items() if key != "hash"})).hexdigest()


def _no_constant(name: str) -> None:
    # NaN and Infinity are Python's JSON, not JSON: ft never writes them (canonical() refuses them).
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):  # 1e999: a literal past float's range reads as infinity
        _no_constant("inf")
    return value


def parse_entry(line: bytes) -> dict:
    """One line as an entry's fields, or ValueError saying why it is none (its hash is not checked)."""
    if len(line) > MAX_ENTRY_BYTES:
        raise ValueError(f"over {MAX_ENTRY_BYTES} bytes: not an entry ft writes")
    try:
        entry = json.loads(line, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise ValueError("nested too deeply: not an entry ft writes") from None
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(entry, dict) or set(entry) != ENTRY_KEYS:
        raise ValueError("not an entry (its fields are not seq, kind, time, body, artifacts, prev, hash)")
    if type(entry["seq"]) is not int or not isinstance(entry["kind"], str) or not isinstance(entry["body"], dict) \
            or not isinstance(entry["artifacts"], dict) or not isinstance(entry["prev"], str) \
            or not isinstance(entry["hash"], str) or type(entry["time"]) not in (int, float):
        raise ValueError("not an entry (a field of the wrong type)")
    return entry


def read_receipt(path: Path) -> bytes:
    """The receipt's bytes: a regular file of at most MAX_RECEIPT_BYTES (never a FIFO that blocks)."""
    with open_regular(path) as handle:
        data = handle.read(MAX_RECEIPT_BYTES + 1)
    if len(data) > MAX_RECEIPT_BYTES:
        raise ReceiptError(f"{path} is over {MAX_RECEIPT_BYTES >> 20} MiB: not a receipt ft wrote")
    return data


def file_digest(path: Path) -> tuple[int, str]:
    """A regular file's size and sha256 (OSError for a FIFO or a device in its place)."""
    with open_regular(path) as handle:
        return sha256_stream(handle)


def folder_files(folder: Path, limit: int | None = None) -> list[str]:
    """Every file inside a folder, by its relative name, sorted (links to folders are not followed);
    with a limit, the listing stops once it holds more than that many."""
    names: list[str] = []
    for top, _, files in os.walk(folder, onerror=_raise):
        names += [(Path(top) / name).relative_to(folder).as_posix() for name in files]
        if limit is not None and len(names) > limit:
            break
    return sorted(names)


def _raise(error: OSError) -> None:
    raise error  # a folder that cannot be listed is no folder recorded whole


def folder_digests(folder: Path) -> dict[str, dict]:
    """Every file inside a folder with its size and sha256."""
    digests = {}
    for name in folder_files(folder):
        size, sha256 = file_digest(folder / name)
        digests[name] = {"bytes": size, "sha256": sha256}
    return digests


class Receipt:
    """The receipt of the run in `run_dir`."""

    def __init__(self, run_dir: Path):
        self.layout = RunLayout(Path(run_dir))

    @property
    def path(self) -> Path:
        return self.layout.receipt

    @property
    def run_id(self) -> str:
        return self.layout.root.name

    def append(self, kind: str, body: Mapping | None = None, artifacts: Mapping[str, Path | Digest] | None = None,
               prunable: bool = False) -> dict:
        """Record what happened, with the files it used or made (a folder: each file inside), and
        link it to the entry before. The files are hashed before the lock is taken: a large adapter
        never holds up the run's other appenders. ReceiptError when it cannot be recorded."""
        if not KIND_PATTERN.fullmatch(kind):
            raise ReceiptError(f"{kind!r} is not an entry kind: 1-40 lowercase letters, digits, '_' or '-'")
        try:
            recorded = {name: self.artifact(source, prunable) for name, source in sorted((artifacts or {}).items())}
            with locked(self.layout.receipt_lock):
                last = self.last()
                entry = {"seq": last["seq"] + 1 if last else 1, "kind": kind, "time": time.time(),
                         "body": dict(body or {}), "artifacts": recorded, "prev": last["hash"] if last else GENESIS}
                entry["hash"] = entry_hash(entry)
                line = canonical(entry) + b"\n"
                if len(line) > MAX_ENTRY_BYTES:
                    raise ReceiptError(f"a {kind} entry of {len(line)} bytes is over {MAX_ENTRY_BYTES}: record "
                                       "a manifest file instead of a long list")
                self.write(line)
        except (TypeError, ValueError) as exc:
            raise ReceiptError(f"the {kind} entry is not plain JSON: {exc}") from None
        except OSError as exc:
            raise ReceiptError(f"could not append to {self.path}: {exc}") from None
        return entry

    def artifact(self, source: Path | Digest, prunable: bool) -> dict:
        if isinstance(source, Digest):
            if type(source.bytes) is not int or source.bytes < 0 or not SHA256_PATTERN.fullmatch(source.sha256):
                raise ReceiptError(f"{source} is not a size and a lowercase hex sha256")
            record = {"path": self.recorded_path(source.path), "bytes": source.bytes, "sha256": source.sha256}
        elif Path(source).is_dir():
            record = {"path": self.recorded_path(source), "files": folder_digests(Path(source))}
        else:
            size, sha256 = file_digest(Path(source))
            record = {"path": self.recorded_path(source), "bytes": size, "sha256": sha256}
        return record | ({"prunable": True} if prunable else {})

    def recorded_path(self, path: Path) -> str:
        """Relative to the run folder where inside it (the receipt still holds when the run is moved)."""
        absolute, root = Path(os.path.abspath(path)), Path(os.path.abspath(self.layout.root))
        return absolute.relative_to(root).as_posix() if absolute.is_relative_to(root) else str(absolute)

    def last(self) -> dict | None:
        """The last entry (read from the file's end only), None before the first. ReceiptError when the
        receipt ends in a damaged line: nothing is linked to an entry that cannot be read."""
        try:
            handle = open_regular(self.path)
        except FileNotFoundError:
            return None
        with handle:
            start = max(0, os.fstat(handle.fileno()).st_size - MAX_ENTRY_BYTES - 1)
            handle.seek(start)
            tail = handle.read()
        if not tail:
            return None
        lines = tail.split(b"\n")
        if lines[-1] or (start and len(lines) < 3):
            raise ReceiptError(f"{self.path} ends in a cut or overlong line", hint=f"ft receipt verify {self.run_id}")
        try:
            entry = parse_entry(lines[-2])
        except ValueError as exc:
            raise ReceiptError(f"{self.path}'s last line is damaged: {exc}",
                               hint=f"ft receipt verify {self.run_id}") from None
        if not SHA256_PATTERN.fullmatch(entry["hash"]):
            raise ReceiptError(f"{self.path}'s last entry has no usable hash", hint=f"ft receipt verify {self.run_id}")
        return entry

    def first(self) -> dict:
        """The first entry (`ft submit`'s: it records the job script); ReceiptError where it is not one."""
        try:
            with open_regular(self.path) as handle:
                line = handle.readline(MAX_ENTRY_BYTES + 1)
        except OSError as exc:
            raise ReceiptError(f"{self.path} cannot be read: {exc}") from None
        try:
            return parse_entry(line.rstrip(b"\n"))
        except ValueError as exc:
            raise ReceiptError(f"{self.path}'s first line is damaged: {exc}",
                               hint=f"ft receipt verify {self.run_id}") from None

    def write(self, line: bytes) -> None:
        """One line at the end, fsynced: a reader sees it whole or not at all."""
        descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        try:
            if not stat.S_ISREG(os.fstat(descriptor).st_mode):
                raise OSError(f"{self.path} is not a regular file")
            view = memoryview(line)
            while view:
                view = view[os.write(descriptor, view):]
            os.fsync(descriptor)
        finally:
            os.close(descriptor)

    def seal(self, socket_path: str | Path, timeout: float = SEAL_TIMEOUT_S) -> dict:
        """Have the site's signer sign the receipt as it stands (its entry count and last hash) and
        write the signature to receipt.sig. The signer signs only while Slurm runs a job of this
        run for this user, whose batch script is the job script the first entry records. Returns
        what was signed with its signature; ReceiptError when the signer refuses or does not answer
        (the receipt stays as it was)."""

        try:
            with locked(self.layout.receipt_lock):  # no entry slips in between what is signed and the file
                last = self.last()
                if last is None:
                    raise ReceiptError(f"{self.path} has no entry to sign")
                signed = request_signature(Path(socket_path), self.run_id, last["seq"], last["hash"], self.first(),
                                           timeout)
                write_atomically(self.layout.receipt_signature, canonical(signed).decode() + "\n")
        except OSError as exc:
            raise ReceiptError(f"could not seal {self.path}: {exc}") from None
        return signed
