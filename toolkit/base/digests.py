"""SHA-256 of a file's bytes, read in blocks (a checkpoint shard or a dataset is never held whole in
memory): the one streaming hasher under checkpoint manifests, the token cache's keys and entries,
the model cache, and receipts. The registry reads exactly a file's size on its own descriptor
(toolkit/registry/adapter.py: a file that grows or shrinks while read is refused there)."""

from __future__ import annotations

import base64
import binascii
import hashlib
from pathlib import Path

BLOCK = 1 << 22


def sha256_stream(handle) -> tuple[int, str]:
    """Size and SHA-256 of what a binary file object holds from where it stands to its end."""
    digest, size = hashlib.sha256(), 0
    for block in iter(lambda: handle.read(BLOCK), b""):
        digest.update(block)
        size += len(block)
    return size, digest.hexdigest()


def sha256_file(path: Path) -> str:
    with open(path, "rb") as handle:
        return sha256_stream(handle)[1]


# A site key's public half as the cluster profile writes it (receipts.public_key), and its id: the
# profile checks them with the standard library alone (toolkit/receipts/keys.py uses the key).
def public_key_bytes(text: str) -> bytes:
    """The raw 32 bytes of a public key written as base64, or ValueError."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{text!r} is not base64") from None
    if len(raw) != 32:
        raise ValueError(f"an ed25519 public key is 32 bytes, this one {len(raw)}")
    return raw


def key_id(public_raw: bytes) -> str:
    return hashlib.sha256(public_raw).hexdigest()[:16]
