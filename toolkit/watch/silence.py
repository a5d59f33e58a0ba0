"""When a quiet node is lost: the one rule the supervisor (about the training nodes) and the
launchers (about the batch host) follow.

Heartbeats come every heartbeat.INTERVAL_S. A node quiet for QUIET_S is asked about: its slurmd
probed, a TCP connect to SlurmdPort. A crashed node answers nothing (power lost, kernel panic: the
connect is refused or times out within PROBE_TIMEOUT_S), and is lost at once, within about QUIET_S
+ PROBE_TIMEOUT_S of its last heartbeat. A quiet node whose slurmd answers is alive but late (a
launcher starved of CPU, a flood of datagrams dropping heartbeats): it is given the recipe's
`watchdog.heartbeat_timeout` before it counts as lost. So the fast path needs two
signs, and a loaded node never loses its place to one late datagram.

Both signs travel the same network, though: where half the nodes or more (two at least) go quiet at
once, the likelier cause is the asker's own link (a flap, a failover), not that many crashes; they
then wait for the timeout, as does a node with nothing to probe.

QUIET_S is set from the heartbeat gaps measured on the loaded lab (benchmarks/false_alarms.py,
benchmarks/FALSE_ALARMS.md): the longest gap seen there, with room.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from toolkit.slurm.client import SlurmClient

QUIET_S = 1.0  # a node quiet this long is asked about
PROBE_TIMEOUT_S = 0.8  # toolkit/slurm/nodes.py's slurmd_answers: two connects of 0.4 s at most
PROBE_EVERY_S = 0.5  # a quiet node whose slurmd answered is asked again this often
# Slurm may return a node it was just told is DOWN to service on a response it had from the node
# before the crash (ReturnToService=2: seen on 24.11 0.15 s after ft's mark, a second after the
# crash): looked at again after these many seconds, and marked DOWN again while it answers nothing.
DOWN_LOOKS_S = (1.5, 3.0)


def keep_down(slurm: SlurmClient, node: str, reason: str, still_dead: Callable[[], bool],
              log: Callable[[str], None], looks: tuple[float, ...] = DOWN_LOOKS_S) -> threading.Thread:
    """A node ft marked DOWN stays DOWN while it is dead: in a thread of its own (the restart does not
    wait), Slurm's word looked at again; a node back in service that still does not answer is marked
    DOWN again, so that no job (the requeued one first) is started on it."""
    def watch() -> None:
        began = time.monotonic()
        for at in looks:
            time.sleep(max(at - (time.monotonic() - began), 0))
            try:
                down = node in slurm.unresponsive([node])
                if not down and still_dead():
                    slurm.mark_node_down(node, reason)
                    log(f"Slurm took {node} back on a word from before its crash: marked DOWN again")
            except Exception:  # noqa: BLE001 - a busy controller: Slurm's own timeout is left
                return

    thread = threading.Thread(target=watch, name=f"ft-keep-down-{node}", daemon=True)
    thread.start()
    return thread


@dataclass
class SilenceRule:
    """`lost(quiet)` names the lost nodes among the quiet ones (node: seconds since its last
    heartbeat) and why. `probe(node)` says whether the node's slurmd answers."""
    timeout: float  # watchdog.heartbeat_timeout: quiet this long, lost whatever its slurmd says
    probe: Callable[[str], bool]
    quick: float = QUIET_S
    asked: dict[str, float] = field(default_factory=dict)  # node: when its slurmd last answered

    def lost(self, quiet: dict[str, float], nodes: int) -> dict[str, str]:
        """`quiet`: seconds since each node's last heartbeat; `nodes`: how many are watched."""
        found = {node: f"no heartbeat for {self.timeout:.0f} s" for node, seconds in quiet.items()
                 if seconds >= self.timeout}
        for node in [n for n in self.asked if quiet.get(n, 0.0) < self.quick]:  # heard again: asked afresh
            del self.asked[node]
        candidates = [node for node, seconds in quiet.items() if node not in found and seconds >= self.quick]
        if self.many(len(candidates), nodes):
            return found
        now = time.monotonic()
        ask = [node for node in candidates if now - self.asked.get(node, float("-inf")) >= PROBE_EVERY_S]
        for node, answered in zip(ask, self.probe_all(ask), strict=True):
            if answered:
                self.asked[node] = now
            else:
                found[node] = f"no heartbeat for {quiet[node]:.1f} s and its slurmd does not answer"
        return found

    @staticmethod
    def many(quiet: int, nodes: int) -> bool:
        """Too many quiet at once to be crashes: the asker's own network is the likelier cause."""
        return quiet >= 2 and 2 * quiet >= nodes

    def probe_all(self, nodes: list[str]) -> list[bool]:
        """All at once: several nodes lost together (a rack's switch) cost one probe's time."""
        if len(nodes) <= 1:
            return [self.probe(node) for node in nodes]
        answers = [True] * len(nodes)  # a probe that does not come back in time is no sign of loss

        def ask(index: int) -> None:
            answers[index] = self.probe(nodes[index])

        threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(len(nodes))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=PROBE_TIMEOUT_S * 2)
        return answers
