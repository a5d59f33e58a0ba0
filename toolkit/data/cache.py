"""The tokenized dataset, cached on the shared filesystem and keyed by what decides its tokens: the
data's bytes, the tokenizer, max_seq_len, the format and the split. Validation writes it; the
training workers read it; a second validation or run of the same data tokenizes nothing.

<root>/<key>/  tokens.bin (int32), labels.bin (int32), offsets.bin (int64), eval.bin (uint8), meta.json

An entry is written into a staging folder and renamed into place whole; meta.json (written last)
records its key and each file's size and SHA-256. An entry is trusted only when all of these
match: a half-written, truncated or foreign entry reads as missing (and is built again).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import uuid
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from toolkit.base.cache_entries import discard, exclusive
from toolkit.base.digests import sha256_stream
from toolkit.storage.object_store import ObjectStore

FLUSH_EVERY = 1 << 20  # values buffered before they go to disk: memory stays bounded
FILES = {"tokens": "i", "labels": "i", "offsets": "q", "eval": "B"}  # name -> array typecode


# A local file's digest, once per process while its size and mtime hold: a run's workers key the
# token cache by it, and its receipt and registry entry record it (one read of the data, not three).
_DIGESTS: dict[tuple[str, int, int], str] = {}


def file_digest(url: str, store: ObjectStore) -> str:
    try:
        info = os.stat(url) if "://" not in url else None
    except OSError:
        info = None
    known = (url, info.st_size, info.st_mtime_ns) if info else None
    if known in _DIGESTS:
        return _DIGESTS[known]
    with store.open(url, "rb") as handle:
        digest = sha256_stream(handle)[1]
    if known:
        _DIGESTS[known] = digest
    return digest


def describe_files(folder: Path, digests: bool = True) -> dict:
    """Size and SHA-256 of each data file of an entry: what meta.json vouches for."""
    described = {}
    for name in FILES:
        with open(folder / f"{name}.bin", "rb") as handle:
            described[name] = {"bytes": os.fstat(handle.fileno()).st_size}
            if digests:
                described[name]["sha256"] = sha256_stream(handle)[1]
    return described


def read_entry(folder: Path, digests: bool = True) -> tuple[dict | None, str | None]:
    """An entry's meta.json and why the entry is not to be trusted (None when it is). A missing
    entry is (None, None)."""
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as exc:
        return None, f"meta.json is unreadable ({exc})"
    if not isinstance(meta, dict):
        return None, "meta.json is not an object"
    return meta, entry_problem(folder, folder.name, meta, digests)


def entry_problem(folder: Path, key: str, meta: dict, digests: bool = True) -> str | None:
    """Why an entry is not to be trusted, or None."""
    if meta.get("key") != key:
        return f"meta.json names key {meta.get('key')!r}, not its folder's"
    files = meta.get("files")
    if not isinstance(files, dict) or set(files) != set(FILES):
        return "meta.json does not describe the entry's files"
    try:
        actual = describe_files(folder, digests)
    except OSError as exc:
        return f"a file is missing or unreadable: {exc}"
    fields = ("bytes", "sha256") if digests else ("bytes",)
    changed = [name for name in FILES if not isinstance(files[name], dict)
               or any(actual[name][field] != files[name].get(field) for field in fields)]
    if changed:
        return f"{', '.join(name + '.bin' for name in changed)} differ from meta.json (truncated or changed)"
    return None


def cache_key(data_digest: str, tokenizer_identity: str, fmt: str, max_seq_len: int, too_long: str,
              eval_fraction: float, seed: int) -> str:
    text = json.dumps([data_digest, tokenizer_identity, fmt, max_seq_len, too_long, eval_fraction, seed])
    return hashlib.sha256(text.encode()).hexdigest()[:40]


@dataclass
class CachedDataset:
    meta: dict
    tokens: object  # numpy arrays (memory-mapped)
    labels: object
    offsets: object
    eval_flags: object

    def examples(self, held_out: bool = False) -> list[tuple[list[int], list[int]]]:
        """Sequences in file order (preference data: chosen, rejected, chosen, rejected...)."""
        out = []
        for index in range(len(self.offsets) - 1):
            if bool(self.eval_flags[index]) != held_out:
                continue
            start, end = int(self.offsets[index]), int(self.offsets[index + 1])
            out.append((self.tokens[start:end].tolist(), self.labels[start:end].tolist()))
        return out


class CacheWriter:
    def __init__(self, final: Path):
        self.final = final
        self.staging = final.parent / f".{final.name}.{uuid.uuid4().hex[:8]}"
        final.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.staging.mkdir(mode=0o700)
        self.buffers = {name: array(code) for name, code in FILES.items()}
        self.buffers["offsets"].append(0)
        self.position = 0

    def add(self, ids: list[int], labels: list[int], held_out: bool) -> None:
        self.buffers["tokens"].extend(ids)
        self.buffers["labels"].extend(labels)
        self.position += len(ids)
        self.buffers["offsets"].append(self.position)
        self.buffers["eval"].append(int(held_out))
        if len(self.buffers["tokens"]) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        for name, values in self.buffers.items():
            with open(self.staging / f"{name}.bin", "ab") as handle:
                values.tofile(handle)
            del values[:]

    def finish(self, meta: dict) -> None:
        self.flush()
        meta = {**meta, "key": self.final.name, "files": describe_files(self.staging)}
        (self.staging / "meta.json").write_text(json.dumps(meta) + "\n")
        with exclusive(self.final.parent / ".publish.lock"):  # short: a check and a rename
            meta, problem = read_entry(self.final)
            if meta is not None and problem is None:  # another writer finished first: keep theirs
                shutil.rmtree(self.staging, ignore_errors=True)
                return
            discard(self.final)  # a broken or foreign entry
            self.staging.rename(self.final)

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


class TokenCache:
    def __init__(self, root: Path, warn: Callable[[str], None] | None = None):
        self.root = root
        self.warn = warn or (lambda message: print(f"warning: {message}", file=sys.stderr))

    def path(self, key: str) -> Path:
        return self.root / key

    def meta(self, key: str, digests: bool = True) -> dict | None:
        """The entry's meta.json when the entry is whole and is the one its key names, else None.
        digests=False checks sizes only: for readers after one process has checked the digests."""
        folder = self.path(key)
        meta, problem = read_entry(folder, digests)
        if problem:
            self.warn(f"token cache entry {folder} ignored: {problem}")
            return None
        return meta

    def load(self, key: str, digests: bool = True) -> CachedDataset | None:
        import numpy as np

        meta = self.meta(key, digests)
        if meta is None:
            return None
        folder = self.path(key)

        def read(name, dtype):
            return np.fromfile(folder / f"{name}.bin", dtype=dtype)

        return CachedDataset(meta, read("tokens", np.int32), read("labels", np.int32), read("offsets", np.int64),
                             read("eval", np.uint8))

    def writer(self, key: str) -> CacheWriter:
        return CacheWriter(self.path(key))
