"""A job's side of the site's signer: one request on its Unix socket, one line back, both bounded in
size and time (the signer itself runs on the site's service host: toolkit/services/signer.py)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from toolkit.receipts.canonical import ReceiptError, canonical

REPLY_MAX_BYTES = 64 << 10


def read_line(connection: socket.socket, limit: int, deadline: float) -> bytes:
    """One line (or all until the other side stops writing) of at most `limit` bytes, by `deadline`
    (time.monotonic): ValueError when longer, TimeoutError when later."""
    received = bytearray()
    while b"\n" not in received:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("too slow")
        connection.settimeout(remaining)
        chunk = connection.recv(4096)
        if not chunk:
            break
        received += chunk
        if len(received) > limit + 1:
            raise ValueError(f"over {limit} bytes")
    line = bytes(received).split(b"\n", 1)[0]
    if len(line) > limit:
        raise ValueError(f"over {limit} bytes")
    return line


def request_signature(socket_path: Path, run_id: str, entries: int, head: str, first: dict,
                      timeout: float) -> dict:
    """Ask the signer at `socket_path` to sign a receipt of `entries` entries ending in `head`, whose
    first entry is `first`: {payload, signature}, or ReceiptError saying why not."""
    deadline = time.monotonic() + timeout
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(timeout)
            while True:  # a queue full for a moment (another user's burst) is waited out, to the deadline
                try:
                    connection.connect(str(socket_path))
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise
                    time.sleep(0.05)
            connection.sendall(canonical({"run_id": run_id, "entries": entries, "head": head, "first": first}) + b"\n")
            reply = json.loads(read_line(connection, REPLY_MAX_BYTES, deadline))
    except (OSError, ValueError, RecursionError) as exc:
        raise ReceiptError(f"the receipt signer at {socket_path} did not answer: {exc}",
                           hint="ask the cluster's admins (Ansible role ft_signer)") from None
    if isinstance(reply, dict) and "error" in reply:
        raise ReceiptError(f"the receipt signer refused: {reply['error']}")
    payload = reply.get("payload") if isinstance(reply, dict) else None
    if not isinstance(payload, dict) or not isinstance(reply.get("signature"), str) \
            or (payload.get("run_id"), payload.get("entries"), payload.get("head")) != (run_id, entries, head):
        raise ReceiptError(f"the receipt signer at {socket_path} answered something else than a signature of "
                           "this receipt")
    return {"payload": payload, "signature": reply["signature"]}
