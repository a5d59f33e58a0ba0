"""The site's receipt key: ed25519, made once on one host by Ansible (role ft_signer) and readable
only by the signer's own user; never in a run folder. Its public half goes into the cluster profile
(`receipts.public_key`, base64 of the raw 32 bytes), where `ft receipt verify` finds it; its id is
the first 16 hex digits of the public key's sha256.

    python -m toolkit.receipts.keys KEYFILE

makes the key when there is none (never replacing one) and prints {"public_key", "key_id", "created"}.
The cryptography package is imported only where a key is used: the cluster profile, which every
`ft` command loads, checks a public key with this module's standard-library half.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import sys
import tempfile
from pathlib import Path

from toolkit.base.digests import key_id
from toolkit.base.shared_dirs import open_regular
from toolkit.receipts.canonical import canonical

MAX_KEY_FILE_BYTES = 4096
# What is signed is prefixed with this: a signature over a receipt is never one over anything else.
SIGNING_CONTEXT = b"ft-receipt-v1\n"


def signed_message(payload: dict) -> bytes:
    return SIGNING_CONTEXT + canonical(payload)


def load_private_key(path: Path):
    """The signer's private key (an Ed25519PrivateKey) from its PEM file; ValueError or OSError."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    with open_regular(path) as handle:
        pem = handle.read(MAX_KEY_FILE_BYTES + 1)
    key = load_pem_private_key(pem, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} holds no ed25519 key")
    return key


def raw_public(private_key) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def verify_signature(public_raw: bytes, payload: dict, signature: str) -> bool:
    """Whether `signature` (base64) is the key's over the payload."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        Ed25519PublicKey.from_public_bytes(public_raw).verify(base64.b64decode(signature, validate=True),
                                                              signed_message(payload))
    except (InvalidSignature, binascii.Error, ValueError, TypeError):
        return False
    return True


def generate(path: Path) -> bool:
    """Make the key at `path` (0600, its folder 0700 when missing) unless one is there: True when
    made. Linked into place whole: a key half written, or two made at once, is never used."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat

    if path.exists():
        return False
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    pem = Ed25519PrivateKey.generate().private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mkstemp's mode: 0600
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(pem)
            handle.flush()
            os.fsync(handle.fileno())
        os.link(temporary, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(temporary)
    return True


def main(argv: list[str]) -> int:
    """KEYFILE: make the key unless there is one, and print its public half; KEYFILE --check: make
    nothing (Ansible's check mode), print what is there (nulls, created: true, where none is)."""
    if len(argv) not in (1, 2) or argv[1:] not in ([], ["--check"]):
        print("usage: python -m toolkit.receipts.keys KEYFILE [--check]", file=sys.stderr)
        return 2
    path = Path(argv[0])
    if argv[1:] == ["--check"] and not path.exists():
        print(json.dumps({"public_key": None, "key_id": None, "created": True}))
        return 0
    created = generate(path) if argv[1:] != ["--check"] else False
    raw = raw_public(load_private_key(path))
    print(json.dumps({"public_key": base64.b64encode(raw).decode(), "key_id": key_id(raw), "created": created}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
