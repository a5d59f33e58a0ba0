"""A barrier across the nodes of a job, before any worker starts: every node must reach the first
one. A node that cannot is named in the error, instead of a collective hanging for minutes later.

The barrier listens on a port anyone on the cluster network can reach, so every peer proves it
belongs to the job: node 0 sends a fresh nonce, a node answers with an HMAC of it under the job's
secret (FT_JOB_SECRET, made by the job script, in the job's environment only, never in a file),
and node 0's "go" is an HMAC too. Every read is bounded in size and time: an idle connection, junk
or a forged rank is dropped and logged, never waited on and never accepted.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import queue
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable

BARRIER_PORT_OFFSET = 1  # MASTER_PORT itself is left to torch.distributed
PEER_TIMEOUT_S = 5.0  # one peer's whole exchange
MAX_LINE = 512
MAX_PENDING = 64  # check-ins in progress at once
HOST_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


class RendezvousError(RuntimeError):
    pass


def job_secret() -> bytes:
    secret = os.environ.get("FT_JOB_SECRET", "")
    if len(secret) < 32:
        raise RendezvousError("FT_JOB_SECRET is missing or short: the job script makes it; run the rendered script")
    return secret.encode()


def proof(secret: bytes, *parts: str) -> str:
    return hmac.new(secret, "\n".join(parts).encode(), hashlib.sha256).hexdigest()


def read_line(connection: socket.socket, deadline: float) -> str:
    """One line, at most MAX_LINE bytes, before the deadline; else an OSError."""
    data = b""
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or len(data) > MAX_LINE:
            raise OSError("no complete line in time")
        connection.settimeout(remaining)
        chunk = connection.recv(MAX_LINE + 1 - len(data))
        if not chunk:
            raise OSError("connection closed")
        data += chunk
    return data.decode("ascii", errors="replace").strip()


def _admit(connection: socket.socket, secret: bytes, nodes: int) -> tuple[int, str, str]:
    """A peer's node rank and host name once it has proved it knows the job's secret."""
    deadline = time.monotonic() + PEER_TIMEOUT_S
    nonce = secrets.token_hex(16)
    connection.settimeout(PEER_TIMEOUT_S)
    connection.sendall(f"{nonce}\n".encode())
    fields = read_line(connection, deadline).split(" ")
    if len(fields) != 3 or not fields[0].isdigit() or not HOST_NAME.fullmatch(fields[1]):
        raise OSError("malformed check-in")
    rank, host, mac = int(fields[0]), fields[1], fields[2]
    if not 1 <= rank < nodes:
        raise OSError(f"node rank {rank} is not in this job")
    if not hmac.compare_digest(mac, proof(secret, nonce, str(rank), host)):
        raise OSError("wrong proof of the job's secret")
    return rank, host, nonce


def _serve(port: int, nodes: int, timeout: float, log: Callable[[str], None]) -> dict[int, str]:
    """Accept check-ins until every other node has proved itself. Each peer's exchange runs in its
    own thread, so idle connections (at most MAX_PENDING at once) cost nothing but a thread."""
    secret = job_secret()
    admitted: queue.Queue = queue.Queue()
    pending = threading.BoundedSemaphore(MAX_PENDING)

    def handshake(connection: socket.socket, peer: str) -> None:
        try:
            admitted.put((*_admit(connection, secret, nodes), connection))
        except OSError as exc:
            log(f"rendezvous: refused a connection from {peer}: {exc}")
            connection.close()
        finally:
            pending.release()

    arrived: dict[int, tuple[str, str, socket.socket]] = {}
    deadline = time.monotonic() + timeout
    with socket.create_server(("", port), reuse_port=False) as server:
        server.settimeout(0.2)
        try:
            while len(arrived) < nodes - 1:
                if time.monotonic() > deadline:
                    missing = sorted(set(range(1, nodes)) - set(arrived))
                    raise RendezvousError(f"node ranks {missing} did not reach the rendezvous within {timeout:.0f} s")
                with contextlib.suppress(TimeoutError):
                    connection, peer = server.accept()
                    if pending.acquire(blocking=False):
                        threading.Thread(target=handshake, args=(connection, peer[0]), daemon=True).start()
                    else:
                        connection.close()  # too many unfinished check-ins: a flood, not nodes
                while not admitted.empty():
                    rank, host, nonce, connection = admitted.get()
                    if rank in arrived:  # the same node again (it retried): keep the newest connection
                        arrived[rank][2].close()
                    arrived[rank] = (host, nonce, connection)
            for _, nonce, connection in arrived.values():
                connection.sendall(f"go {proof(secret, 'go', nonce)}\n".encode())
        finally:
            for _, _, connection in arrived.values():
                connection.close()
    return {rank: host for rank, (host, _, _) in arrived.items()}


def _join(address: str, port: int, node_rank: int, host: str, timeout: float) -> None:
    secret = job_secret()
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, port), timeout=PEER_TIMEOUT_S) as connection:
                nonce = read_line(connection, time.monotonic() + PEER_TIMEOUT_S)
                connection.sendall(f"{node_rank} {host} {proof(secret, nonce, str(node_rank), host)}\n".encode())
                answer = read_line(connection, deadline)
                if hmac.compare_digest(answer, f"go {proof(secret, 'go', nonce)}"):
                    return
                last_error = RendezvousError("the first node's answer does not prove the job's secret")
        except OSError as exc:
            last_error = exc
        time.sleep(0.5)
    raise RendezvousError(f"node rank {node_rank} ({host}) could not reach the first node {address}:{port} "
                          f"within {timeout:.0f} s: {last_error}")


def barrier(master_addr: str, master_port: int, node_rank: int, nodes: int, host: str,
            timeout: float = 180, log: Callable[[str], None] = print) -> dict[int, str]:
    """Wait until every node has reached node 0. Node 0 returns who arrived."""
    port = master_port + BARRIER_PORT_OFFSET
    if nodes == 1:
        return {}
    if node_rank == 0:
        return _serve(port, nodes, timeout, log)
    _join(master_addr, port, node_rank, host, timeout)
    return {}
