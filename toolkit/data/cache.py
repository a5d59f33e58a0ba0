"""The tokenized dataset, cached on the shared filesystem and keyed by what decides its tokens: the
data's bytes, the tokenizer, max_seq_len, the format and the split. Validation writes it; the
training workers read it; a second validation or run of the same data tokenizes nothing.

<root>/<key>/  tokens.bin (int32), labels.bin (int32), offsets.bin (int64), eval.bin (uint8), meta.json
"""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from array import array
from dataclasses import dataclass
from pathlib import Path

FLUSH_EVERY = 1 << 20  # values buffered before they go to disk: memory stays bounded


def file_digest(url: str) -> str:
    import fsspec

    digest = hashlib.sha256()
    with fsspec.open(url, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


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
        self.staging.mkdir(parents=True)
        self.buffers = {"tokens": array("i"), "labels": array("i"), "offsets": array("q", [0]), "eval": array("B")}
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
        (self.staging / "meta.json").write_text(json.dumps(meta) + "\n")
        if self.final.exists():  # another process finished the same work first: keep theirs
            shutil.rmtree(self.staging, ignore_errors=True)
            return
        self.staging.rename(self.final)

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


class TokenCache:
    def __init__(self, root: Path):
        self.root = root

    def path(self, key: str) -> Path:
        return self.root / key

    def meta(self, key: str) -> dict | None:
        try:
            return json.loads((self.path(key) / "meta.json").read_text())
        except (OSError, ValueError):
            return None

    def load(self, key: str) -> CachedDataset | None:
        import numpy as np

        meta = self.meta(key)
        if meta is None:
            return None
        folder = self.path(key)

        def read(name, dtype):
            return np.fromfile(folder / f"{name}.bin", dtype=dtype)

        return CachedDataset(meta, read("tokens", np.int32), read("labels", np.int32), read("offsets", np.int64),
                             read("eval", np.uint8))

    def writer(self, key: str) -> CacheWriter:
        return CacheWriter(self.path(key))
