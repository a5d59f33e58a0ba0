"""Heartbeats: one UDP datagram every INTERVAL_S from every node's launcher to the supervisor.

UDP, because a heartbeat that is late is worthless and a reader must never wait on a peer: the
supervisor reads whole datagrams of bounded size and never blocks on anyone. Anyone on the cluster
network can send to the port, so a datagram counts only when it comes from a node of the job and
carries an HMAC under the job's secret (FT_JOB_SECRET, in the job's environment only), compared as
bytes whatever it holds, and a sequence number that must grow: a forged, replayed or malformed
datagram is dropped and never keeps a dead node alive, nor stops the reader. Each start of the
training (the supervisor may start it several times in one job) has its own number: a launcher
left over from an earlier start is not mistaken for one of the current start.

The supervisor answers each heartbeat, from a thread of its own that never waits on anything else
(a slow Slurm command in the supervisor must not look like a lost batch host). An answer names the
heartbeat it answers, and the nodes of the start found lost: a launcher that hears of one stops its
ranks at once (they would wait on the lost one's collectives until Slurm's KILL), and one that
hears no fresh answer for long knows the batch host is lost
(when silence means a loss: toolkit/watch/silence.py, the same rule both ways).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import json
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from toolkit.watch.silence import QUIET_S

MAX_DATAGRAM = 4096
INTERVAL_S = 0.25  # four a second: a crash is seen within silence.QUIET_S, not the recipe's timeout
RECEIVE_BUFFER = 4 << 20  # room for a burst of junk without losing the real heartbeats
DRAIN_BATCH = 4096  # datagrams read per wake before looking at the clock again
REFUSALS_KEPT_S = 120  # refused datagrams counted per second, this far back
SOURCES_KEPT = 64  # distinct source addresses counted per second
ANSWERS_PER_BEAT = 64  # datagrams a launcher reads per heartbeat: a flood never starves the sending
REPORT_WAIT_S = 60.0  # a launcher ending waits this long for its report of a lost batch host to reach Slurm


def job_tag(secret: bytes) -> bytes:
    """The job's 16-byte mark, first in each of its datagrams: a datagram without it is dropped with
    one comparison, before any HMAC (a flood of junk costs the reader little). Derived from the
    secret, so only the job's processes know it (one who can read the job's traffic could copy it:
    the HMAC still refuses what they send)."""
    return hmac.new(secret, b"ft-heartbeat-tag", hashlib.sha256).hexdigest()[:16].encode()


def seal(secret: bytes, message: dict) -> bytes:
    body = json.dumps(message, sort_keys=True, separators=(",", ":")).encode()
    return job_tag(secret) + hmac.new(secret, body, hashlib.sha256).hexdigest().encode() + b" " + body


def unseal(secret: bytes, datagram: bytes, tag: bytes | None = None) -> dict | None:
    """The message, or None when it is not one sealed with this job's secret (whatever the bytes)."""
    tag = tag or job_tag(secret)
    if len(datagram) > MAX_DATAGRAM or not datagram.startswith(tag):
        return None
    mac, _, body = datagram[len(tag):].partition(b" ")
    if not hmac.compare_digest(mac, hmac.new(secret, body, hashlib.sha256).hexdigest().encode()):
        return None
    try:
        message = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return message if isinstance(message, dict) and type(message.get("seq")) is int else None


class Sender:
    """A launcher's heartbeat: `state()` (its ranks' steps, its exit code once known) sent every
    INTERVAL_S until stopped; a last datagram says goodbye. `on_silence(quiet)` is called, in a
    thread of its own, when the supervisor, having answered before, has answered none of the
    heartbeats of the last `quiet` >= silence.QUIET_S seconds; again while the silence lasts,
    until it returns True (the silence is judged: reported, or left to Slurm). `silence_s` is the
    recipe's heartbeat timeout: how long a launcher ending with a failure waits for an answer."""

    def __init__(self, address: str, port: int, secret: bytes, node: str, start: int, state: Callable[[], dict],
                 silence_s: float = 0, on_silence: Callable[[float], None] | None = None):
        self.target, self.secret, self.node, self.start_number, self.state = (address, port), secret, node, start, state
        self.tag = job_tag(secret)
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.socket.setblocking(False)
        self.seq = 0
        self.exit_code: int | None = None  # sent with every heartbeat once the launcher is ending
        self.answered: float | None = None  # monotonic time of the supervisor's newest fresh answer
        self.answered_seq = 0  # the newest heartbeat it answered
        self.silence_s, self.on_silence = silence_s, on_silence
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ft-heartbeat", daemon=True)
        self.reporting: threading.Thread | None = None
        self.judged = False  # on_silence returned True: the silence is dealt with
        self.peers_lost = threading.Event()  # the supervisor said a node of this start is lost
        self.lost: list[str] = []

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
            quiet = time.monotonic() - self.answered if self.answered is not None else 0.0
            if self.on_silence and not self.judged and quiet >= QUIET_S and not (
                    self.reporting and self.reporting.is_alive()):
                self.reporting = threading.Thread(target=self._judge, args=(quiet,), name="ft-silence", daemon=True)
                self.reporting.start()

    def _judge(self, quiet: float) -> None:
        try:
            self.judged = bool(self.on_silence(quiet))
        except Exception as exc:  # noqa: BLE001 - judged (Slurm's own timeout is left), never asked again in a loop
            self.judged = True
            print(f"ft-heartbeat: judging the supervisor's silence failed: {type(exc).__name__}: {exc}", flush=True)

    def retarget(self, address: str, port: int) -> None:
        """Heartbeats go to another supervisor from now on (a lost batch host's successor:
        toolkit/launch/handover.py); its silence counts from now."""
        self.target = (address, port)
        self.answered = time.monotonic()

    def unanswered(self) -> bool:
        """No fresh answer for silence.QUIET_S or more."""
        return self.answered is None or time.monotonic() - self.answered >= QUIET_S

    def read_answers(self) -> None:
        for _ in range(ANSWERS_PER_BEAT):
            try:
                datagram, source = self.socket.recvfrom(MAX_DATAGRAM + 1)
            except OSError:  # nothing more to read (or an ICMP error from an earlier send)
                return
            if source != self.target:
                continue
            answer = unseal(self.secret, datagram, self.tag)
            fresh = answer and answer.get("answer") == self.node and answer.get("start") == self.start_number \
                and type(answer.get("to")) is int and self.answered_seq < answer["to"] <= self.seq
            if fresh:  # a replayed answer names a heartbeat answered before: it proves nothing
                self.answered, self.answered_seq = time.monotonic(), answer["to"]
                self.judged = False  # a later silence is judged afresh
                lost = answer.get("lost")
                if isinstance(lost, list) and lost and all(isinstance(node, str) for node in lost):
                    self.peers_gone(lost)

    def peers_gone(self, nodes: list[str]) -> None:
        """Nodes of this start are lost (the supervisor says so, or this launcher found the batch host
        gone): this node's ranks stop at once (toolkit/launch/workers.py)."""
        self.lost = nodes
        self.peers_lost.set()

    def stop(self, exit_code: int, linger: float = 0.0) -> None:
        """Say goodbye. A launcher that failed first lingers until the supervisor answers, or until
        its silence shows the batch host is gone (the failure may be that: a collective breaks as
        soon as the batch host's ranks die), so that the silence is noticed and reported."""
        self.exit_code = exit_code
        asked, deadline = self.seq, time.monotonic() + linger  # an answer to a heartbeat sent from now on
        while time.monotonic() < deadline and self.on_silence and not self.judged and self.thread.is_alive():
            if self.answered_seq > asked:
                break
            time.sleep(0.1)
        self.stopped.set()
        self.thread.join(timeout=2)
        self.send()
        if self.reporting is not None:  # the silence is being reported (Slurm told): let it finish
            self.reporting.join(timeout=REPORT_WAIT_S)


class Refusals:
    """Refused datagrams per second (the last REFUSALS_KEPT_S), and per source address (the top few
    named in the log). Bounded: a flood from any number of addresses keeps only counts."""

    def __init__(self) -> None:
        self.seconds: collections.deque[list] = collections.deque()  # [second, count, Counter of sources]
        self.lock = threading.Lock()

    def add(self, address: str) -> None:
        second = int(time.monotonic())
        with self.lock:
            if not self.seconds or self.seconds[-1][0] != second:
                self.seconds.append([second, 0, collections.Counter()])
                while self.seconds and self.seconds[0][0] < second - REFUSALS_KEPT_S:
                    self.seconds.popleft()
            bucket = self.seconds[-1]
            bucket[1] += 1
            if address in bucket[2] or len(bucket[2]) < SOURCES_KEPT:
                bucket[2][address] += 1

    def since(self, start: float) -> tuple[int, list[str]]:
        with self.lock:
            buckets = [bucket for bucket in self.seconds if bucket[0] >= int(start)]
        sources = sum((bucket[2] for bucket in buckets), collections.Counter())
        return sum(bucket[1] for bucket in buckets), [address for address, _ in sources.most_common(3)]


@dataclass
class NodeSeen:
    last: float  # monotonic time of the newest heartbeat
    seq: int
    message: dict = field(default_factory=dict)
    longest_gap: float = 0.0  # the longest wait between two of its heartbeats in this start


class Receiver:
    """The supervisor's side: who was heard from, and when. `listen()` reads and answers in a
    thread of its own; `poll()` does the same in the caller (tests). `sources`, when given, are
    the only addresses heard (the job's nodes): anything else is dropped before its HMAC is
    computed, so a flood costs little."""

    def __init__(self, secret: bytes, host: str = "0.0.0.0", sources: set[str] | None = None):
        self.secret, self.sources, self.tag = secret, sources, job_tag(secret)
        self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with contextlib.suppress(OSError):
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        self.socket.setblocking(False)
        self.socket.bind((host, 0))
        self.refusals = Refusals()
        self.port = self.socket.getsockname()[1]
        self.nodes: dict[str, NodeSeen] = {}
        self.refused = 0
        self.answers = 0
        self.start_number = 0
        self.lost: list[str] = []  # nodes of this start found lost: every answer says so
        self.lock = threading.Lock()
        self.closed = threading.Event()

    def listen(self) -> Receiver:
        threading.Thread(target=self._listen, name="ft-heartbeats", daemon=True).start()
        return self

    def _listen(self) -> None:
        while not self.closed.is_set():
            self.poll(time.monotonic() + 0.5)

    def poll(self, until: float) -> None:
        """Read and answer every datagram that arrives before `until` (monotonic): wait for the
        socket once, then drain what the kernel holds, one system call a datagram."""
        while (remaining := until - time.monotonic()) > 0 and not self.closed.is_set():
            try:
                readable, _, _ = select.select([self.socket], [], [], remaining)
            except (OSError, ValueError):  # closed under the wait
                return
            if not readable:
                return
            for _ in range(DRAIN_BATCH):
                try:
                    datagram, source = self.socket.recvfrom(MAX_DATAGRAM + 1)
                except BlockingIOError:
                    break
                except OSError:
                    if self.closed.is_set():
                        return
                    break
                try:
                    self.take(datagram, source)
                except Exception:  # noqa: BLE001 - no datagram, however made, stops the reader
                    self.refuse(source)

    def refuse(self, source: tuple[str, int]) -> None:
        """Counted as a flood only from the job's own addresses: junk from elsewhere never reaches
        the job's sockets on a fabric that filters sources, and must not make silence look excusable."""
        self.refused += 1
        if self.sources is None or source[0] in self.sources:
            self.refusals.add(source[0])

    def take(self, datagram: bytes, source: tuple[str, int]) -> None:
        if self.sources is not None and source[0] not in self.sources or not datagram.startswith(self.tag):
            self.refuse(source)  # the cheap checks first: a flood costs a comparison a datagram
            return
        message = unseal(self.secret, datagram, self.tag)
        node = message.get("node") if message else None
        with self.lock:
            seen = self.nodes.get(node) if isinstance(node, str) else None
            if not isinstance(node, str) or message.get("start") != self.start_number or (
                    seen and message["seq"] <= seen.seq):
                self.refuse(source)
                return
            now = time.monotonic()
            self.nodes[node] = NodeSeen(now, message["seq"], message,
                                        max(seen.longest_gap, now - seen.last) if seen else 0.0)
            self.answers += 1
            answer = seal(self.secret, {"answer": node, "start": self.start_number, "seq": self.answers,
                                        "to": message["seq"], **({"lost": self.lost} if self.lost else {})})
        with contextlib.suppress(OSError):
            self.socket.sendto(answer, source)

    def flood(self, window_s: float) -> tuple[int, list[str]]:
        """Datagrams refused in the last `window_s` seconds, and the sources that sent most of them:
        where a job's own traffic is a few datagrams a second, thousands are a flood, under which
        the kernel drops real heartbeats too, so silence alone proves no loss."""
        return self.refusals.since(time.monotonic() - window_s)

    def next_start(self) -> int:
        """A new start of the training: only its launchers are heard from now on."""
        with self.lock:
            self.nodes.clear()
            self.lost = []
            self.start_number += 1
            return self.start_number

    def adopt_start(self, start: int) -> None:
        """Hear the launchers of a start another supervisor began (a successor's, toolkit/job/successor.py)."""
        with self.lock:
            self.nodes.clear()
            self.lost = []
            self.start_number = start

    def tell_lost(self, nodes: list[str]) -> None:
        """Every answer from now on says these nodes of the start are lost (the launchers stop their
        ranks at once: within a heartbeat)."""
        with self.lock:
            self.lost = sorted(set(self.lost) | set(nodes))

    def seen(self) -> dict[str, NodeSeen]:
        with self.lock:
            return dict(self.nodes)

    def close(self) -> None:
        self.closed.set()
        self.socket.close()
