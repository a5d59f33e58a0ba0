"""A barrier across the nodes of a job, before any worker starts: every node must reach the first
one. A node that cannot is named in the error, instead of a collective hanging for minutes later."""

from __future__ import annotations

import socket
import time

BARRIER_PORT_OFFSET = 1  # MASTER_PORT itself is left to torch.distributed


class RendezvousError(RuntimeError):
    pass


def _serve(port: int, nodes: int, timeout: float) -> dict[int, str]:
    arrived: dict[int, str] = {}
    connections: list[socket.socket] = []
    deadline = time.monotonic() + timeout
    with socket.create_server(("", port), reuse_port=False) as server:
        server.settimeout(1.0)
        while len(arrived) < nodes - 1:
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, nodes)) - set(arrived))
                raise RendezvousError(f"node ranks {missing} did not reach the rendezvous within {timeout:.0f} s")
            try:
                connection, _ = server.accept()
            except TimeoutError:
                continue
            rank, _, host = connection.recv(256).decode().partition(" ")
            arrived[int(rank)] = host
            connections.append(connection)
        for connection in connections:
            connection.sendall(b"go")
            connection.close()
    return arrived


def _join(address: str, port: int, node_rank: int, host: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, port), timeout=5) as connection:
                connection.sendall(f"{node_rank} {host}".encode())
                connection.settimeout(max(1.0, deadline - time.monotonic()))
                if connection.recv(2) == b"go":
                    return
        except OSError as exc:
            last_error = exc
            time.sleep(0.5)
    raise RendezvousError(f"node rank {node_rank} ({host}) could not reach the first node {address}:{port} "
                          f"within {timeout:.0f} s: {last_error}")


def barrier(master_addr: str, master_port: int, node_rank: int, nodes: int, host: str,
            timeout: float = 180) -> dict[int, str]:
    """Wait until every node has reached node 0. Node 0 returns who arrived."""
    port = master_port + BARRIER_PORT_OFFSET
    if nodes == 1:
        return {}
    if node_rank == 0:
        return _serve(port, nodes, timeout)
    _join(master_addr, port, node_rank, host, timeout)
    return {}
