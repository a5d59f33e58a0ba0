"""Heartbeats: one UDP datagram a second from every node's launcher to the supervisor.

UDP, because a heartbeat that is late is worthless and a reader must never wait on a peer: the
supervisor reads whole datagrams of bounded size and never blocks on anyone. Anyone on the cluster
network can send to the port, so every datagram carries an HMAC under the job's secret
(FT_JOB_SECRET, in the job's environment only) and a sequence number that must grow: a forged or
replayed heartbeat is dropped and never keeps a dead node alive. Each start of the training (the
supervisor may start it several times in one job) has its own number: a launcher left over from an
earlier start is not mistaken for one of the current start.

The supervisor answers each heartbeat (sealed the same way): a launcher that hears nothing back for
long knows the batch host is lost, and says so to Slurm (the job script died with it, so nobody
else in the job can).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_DATAGRAM = 4096
INTERVAL_S = 1.0


def seal(secret: bytes, message: dict) -> bytes:
    body = json.dumps(message, sort_keys=True, separators=(",", ":"))
    return (hmac.new(secret, body.encode(), hashlib.sha256).hexdigest() + " " + body).encode()


def unseal(secret: bytes, datagram: bytes) -> dict | None:
    """The message, or None when it is not one this job's launchers sent."""
    if len(datagram) > MAX_DATAGRAM:
        return None
    mac, _, body = datagram.decode("ascii", errors="replace").partition(" ")
    if not hmac.compare_digest(mac, hmac.new(secret, body.encode(), hashlib.sha256).hexdigest()):
        return None
    try:
        message = json.loads(body)
    except ValueError:
        return None
    return message if isinstance(message, dict) and isinstance(message.get("seq"), int) else None


class Sender:
    """A launcher's heartbeat: `state()` (its ranks' steps, its exit code once known) sent every
    INTERVAL_S until stopped; a last datagram says goodbye. `on_silence` is called once when the
    supervisor, having answered before, has not answered for `silence_s` seconds."""

    def __init__(self, address: str, port: int, secret: bytes, node: str, start: int, state: Callable[[], dict],
                 silence_s: float = 0, on_silence: Callable[[float], None] | None = None):
        self.target, self.secret, self.node, self.start_number, self.state = (address, port), secret, node, start, state
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.setblocking(False)
        self.seq = 0
        self.exit_code: int | None = None  # sent with every heartbeat once the launcher is ending
        self.answered: float | None = None  # monotonic time of the supervisor's newest answer
        self.answered_seq = 0  # the newest heartbeat it answered
        self.silence_s, self.on_silence = silence_s, on_silence
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ft-heartbeat", daemon=True)

    def start(self) -> Sender:
        self.thread.start()
        return self

    def send(self) -> None:
        self.seq += 1
        ending = {} if self.exit_code is None else {"exit_code": self.exit_code}
        message = {"node": self.node, "start": self.start_number, "seq": self.seq, **self.state(), **ending}
        with contextlib.suppress(OSError):  # an unreachable supervisor is the supervisor's problem
            self.socket.sendto(seal(self.secret, message), self.target)

    def _run(self) -> None:
        while not self.stopped.wait(INTERVAL_S):
            self.send()
            self.read_answers()
            if (self.on_silence and self.answered is not None
                    and time.monotonic() - self.answered > self.silence_s):
                self.on_silence(time.monotonic() - self.answered)
                self.on_silence = None

    def read_answers(self) -> None:
        while True:
            try:
                datagram = self.socket.recv(MAX_DATAGRAM + 1)
            except (BlockingIOError, OSError):
                return
            answer = unseal(self.secret, datagram)
            if answer and answer.get("answer") == self.node and answer.get("start") == self.start_number:
                self.answered = time.monotonic()
                if isinstance(answer.get("to"), int):
                    self.answered_seq = max(self.answered_seq, answer["to"])

    def stop(self, exit_code: int, linger: float = 0.0) -> None:
        """Say goodbye. A launcher that failed first lingers until the supervisor answers, or until
        its silence shows the batch host is gone (the failure may be that: a collective breaks as
        soon as the batch host's ranks die), so that the silence is noticed and reported."""
        self.exit_code = exit_code
        asked, deadline = self.seq, time.monotonic() + linger  # an answer to a heartbeat sent from now on
        while time.monotonic() < deadline and self.on_silence is not None and self.thread.is_alive():
            if self.answered_seq > asked:
                break
            time.sleep(0.1)
        self.stopped.set()
        self.thread.join(timeout=2)
        self.send()


@dataclass
class NodeSeen:
    last: float  # monotonic time of the newest heartbeat
    seq: int
    message: dict = field(default_factory=dict)


class Receiver:
    """The supervisor's side: who was heard from, and when."""

    def __init__(self, secret: bytes, host: str = "0.0.0.0"):
        self.secret = secret
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.bind((host, 0))
        self.socket.settimeout(0.2)
        self.port = self.socket.getsockname()[1]
        self.nodes: dict[str, NodeSeen] = {}
        self.refused = 0
        self.answers = 0
        self.start_number = 0

    def poll(self, until: float) -> None:
        """Read every datagram that arrives before `until` (monotonic)."""
        while (remaining := until - time.monotonic()) > 0:
            self.socket.settimeout(remaining)
            try:
                datagram, sender = self.socket.recvfrom(MAX_DATAGRAM + 1)
            except (TimeoutError, BlockingIOError):
                return
            message = unseal(self.secret, datagram)
            node = message.get("node") if message else None
            seen = self.nodes.get(node) if isinstance(node, str) else None
            if not isinstance(node, str) or message.get("start") != self.start_number or (
                    seen and message["seq"] <= seen.seq):
                self.refused += 1
                continue
            self.nodes[node] = NodeSeen(time.monotonic(), message["seq"], message)
            self.answers += 1
            with contextlib.suppress(OSError):
                self.socket.sendto(seal(self.secret, {"answer": node, "start": self.start_number,
                                                      "seq": self.answers, "to": message["seq"]}), sender)

    def next_start(self) -> int:
        """A new start of the training: only its launchers are heard from now on."""
        self.nodes.clear()
        self.start_number += 1
        return self.start_number

    def close(self) -> None:
        self.socket.close()
