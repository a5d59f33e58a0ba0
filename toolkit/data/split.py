"""A deterministic train / validation split when the recipe gives no eval set: each example goes by
a hash of its own content, so the split holds when rows are reordered or the file is appended to."""

from __future__ import annotations

import hashlib
import json

BUCKETS = 10_000


def is_eval(row: dict, fraction: float, seed: int = 0) -> bool:
    canonical = json.dumps(row, sort_keys=True, ensure_ascii=False).encode()
    digest = hashlib.blake2b(canonical, digest_size=8, salt=seed.to_bytes(8, "little")).digest()
    return int.from_bytes(digest, "little") % BUCKETS < round(fraction * BUCKETS)


def split(rows: list[dict], fraction: float, seed: int = 0) -> tuple[list[dict], list[dict]]:
    train, held_out = [], []
    for row in rows:
        (held_out if fraction > 0 and is_eval(row, fraction, seed) else train).append(row)
    return train, held_out
