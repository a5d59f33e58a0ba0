"""The launchers' barrier on loopback: peers prove the job's secret; an idle, junk or forged
connection is dropped, never waited on, never accepted."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from toolkit.launch.rendezvous import BARRIER_PORT_OFFSET, RendezvousError, barrier, proof

SECRET = "ab" * 32


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1] - BARRIER_PORT_OFFSET


def start_node(port: int, rank: int, nodes: int, results: dict, timeout: float = 30) -> threading.Thread:
    def run():
        try:
            results[rank] = barrier("127.0.0.1", port, rank, nodes, f"node{rank + 1}", timeout=timeout,
                                    log=results.setdefault("log", []).append)
        except RendezvousError as exc:
            results[rank] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def connect(port: int) -> socket.socket:
    deadline = time.monotonic() + 10
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port + BARRIER_PORT_OFFSET), timeout=5)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


@pytest.fixture(autouse=True)
def job_secret(monkeypatch):
    monkeypatch.setenv("FT_JOB_SECRET", SECRET)


@pytest.mark.timeout(60)
def test_three_nodes_meet_despite_an_idle_a_junk_and_a_forged_peer():
    port, results = free_port(), {}
    server = start_node(port, 0, 3, results)
    idle = connect(port)  # connects, then says nothing at all
    junk = connect(port)
    junk.sendall(b"\x00" * 4096)
    forged = connect(port)
    nonce = forged.makefile().readline().strip()
    forged.sendall(f"1 evil {proof(b'not-the-secret', nonce, '1', 'evil')}\n".encode())
    clients = [start_node(port, rank, 3, results) for rank in (1, 2)]
    for thread in (server, *clients):
        thread.join(40)
    assert results[0] == {1: "node2", 2: "node3"}
    assert results[1] == {} and results[2] == {}
    log = "\n".join(results["log"])
    assert "wrong proof of the job's secret" in log and "refused a connection" in log
    for sock in (idle, junk, forged):
        sock.close()


@pytest.mark.timeout(30)
def test_a_rank_outside_the_job_is_refused_and_named_missing():
    port, results = free_port(), {}
    server = start_node(port, 0, 2, results, timeout=3)
    outsider = connect(port)
    nonce = outsider.makefile().readline().strip()
    outsider.sendall(f"5 node6 {proof(SECRET.encode(), nonce, '5', 'node6')}\n".encode())
    server.join(20)
    assert isinstance(results[0], RendezvousError) and "node ranks [1] did not reach" in str(results[0])
    assert "node rank 5 is not in this job" in "\n".join(results["log"])
    outsider.close()


def test_no_secret_no_rendezvous(monkeypatch):
    monkeypatch.delenv("FT_JOB_SECRET")
    with pytest.raises(RendezvousError, match="FT_JOB_SECRET"):
        barrier("127.0.0.1", free_port(), 0, 2, "node1", timeout=1)
