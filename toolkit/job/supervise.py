"""The supervisor: on the batch host, around the job's srun. It starts the training step on the
recipe's number of nodes (the allocation may hold `resources.spare_nodes` more), listens to every
node's heartbeat, and decides what a failure costs:

- a node quiet for a second whose slurmd does not answer either is lost (toolkit/watch/silence.py),
  and so is one silent for `watchdog.heartbeat_timeout` seconds whatever its slurmd says, and one
  drained meanwhile (a health check found it bad, or an admin took it out; Slurm itself would let
  the job run on):
  the step is stopped at once (not when Slurm notices, after SlurmdTimeout), a silent node is
  marked DOWN with a reason naming the run,
  and training starts again from the latest checkpoint on the survivors and a spare node, in the
  same job. With no spare left, it returns exits.NODES_LOST (the nodes in `excluded`), and the job
  requeues itself without them;
- the batch host itself lost: the job script and this supervisor die with it; the launchers on
  the other nodes notice that their heartbeats go unanswered and tell Slurm (toolkit/launch/node.py).
  While the job holds a spare, the batch host trains on no rank (it is the last spare): the job
  goes on, and a successor of this supervisor adopts the training step as it runs (an `Adoption`:
  toolkit/launch/handover.py, toolkit/job/successor.py); else the job is requeued;
- a dead or hung rank, or a failed collective, on nodes that still answer: the same nodes start
  again from the latest checkpoint, after a short backoff, at most `watchdog.max_restarts` times;
  a node blamed for `watchdog.exclude_after_hangs` hangs (a rank of it stopped, or stuck in the
  kernel: toolkit/watch/stacks.py) is drained with the reason and left out, like a lost node;
- a user error (4) or running out of memory (5) goes back to the job unchanged: restarting
  would fail the same way (the job retries out of memory once, with a smaller micro batch);
- under HyperPod's `srun --auto-resume=1`, HyperPod replaces a faulty node and restarts the step
  itself: the supervisor then only watches and records, so that no fault is restarted twice.

The codes are those of toolkit/runs/exits.py; the job (toolkit/job/controller.py) runs the
supervisor and acts on what it returns. Every decision is a line in the batch log and in
<run dir>/events.jsonl.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from toolkit.base.errors import FtError
from toolkit.job.adopted import AdoptedStep, StepListing
from toolkit.launch.handover import Handover
from toolkit.launch.rendezvous import job_secret
from toolkit.receipts import entries as receipt_entries
from toolkit.runs import exits
from toolkit.runs.layout import EXCLUDED, LOST_NODES, SRUN_ERRORS, STEP_COMMAND, RunLayout, RunSpecError
from toolkit.runs.timeline import read_lines, record
from toolkit.slurm import steps
from toolkit.slurm.client import CliSlurmClient, SlurmClient, job_nodes
from toolkit.watch.heartbeat import Receiver
from toolkit.watch.silence import SilenceRule, keep_down

SILENT_AT_END_S = 3.0  # a node quiet this long before srun ended was lost, whatever srun says
WATCH_EVERY_S = 0.1  # the watch loop's beat: a loss is acted on within this of its detection
STOP_GRACE_S = 5.0
LAUNCH_FAILED = b"Application launch failed"  # srun's words for a step that did not launch everywhere
LOST_STOP_GRACE_S = 1.0  # a step with a lost node: nothing worth waiting for (no checkpoint can be taken)
DRAIN_CHECK_S = 5.0  # how often the step's nodes are checked for a drain
# Refused datagrams within a heartbeat timeout that make silence no proof of loss: a job's own
# traffic is a datagram a second a node, so this many are a flood (the kernel drops real ones in it).
FLOOD_DATAGRAMS = 1000
CHECKPOINT_GRACE_S = 120.0  # how long ranks on a drained node may take to checkpoint before the stop


@dataclass
class Lost:
    nodes: list[str]
    why: str
    drained: bool = False  # taken out by someone else: not marked DOWN again
    hung: bool = False  # alive but hanging again and again: drained by ft (an admin looks), not marked DOWN

@dataclass(frozen=True)
class Adoption:
    """A training step this supervisor takes over as it runs: its batch host (`lost`) is gone, and
    this one is its successor (toolkit/job/successor.py)."""
    lost: str
    step_id: str  # "J.S"
    nodes: list[str]
    start: int


@dataclass
class Outcome:
    code: int | None  # srun's exit status; None when the supervisor stopped the step
    lost: Lost | None


def log(message: str) -> None:
    print(f"ft: {time.strftime('%H:%M:%S')} {message}", flush=True)


def master_port(job_id: int, start: int) -> int:
    """A fresh port pair per start (torch's store, and the rendezvous one above it): a step left
    over from an earlier start may still hold the previous pair."""
    return 20000 + (job_id % 2000) * 10 + (2 * start) % 10


def warm_command(command: list[str], node: str, output: str) -> list[str] | None:
    """The step that keeps a warm template of the training runtime on one node of the allocation
    (toolkit/launch/warm.py), from the training step's own srun command: the same options (a
    container, GPUs, the site's extras), one task, sharing the node with the training steps
    (--overlap). One step per node: srun aborts a step over several nodes when one of them fails
    (its I/O to that node breaks), --no-kill or not, and the templates on the survivors and the
    spare died with it, seen on the lab: the start on the spare was then a cold one. None when the
    command does not end in `PYTHON -m toolkit.launch`."""
    if len(command) < 4 or command[-2:] != ["-m", "toolkit.launch"]:
        return None
    return steps.one_task_beside(command[:-3], node, output, [command[-3], "-m", "toolkit.launch.warm"])


def addresses(nodes: list[str]) -> dict[str, str]:
    """The nodes' addresses, for those that resolve."""
    found = {}
    for node in nodes:
        with contextlib.suppress(OSError):
            found[node] = socket.gethostbyname(node)
    return found


def reachable_address(node: str, peers: dict[str, str]) -> str:
    """This host's address as the other nodes reach it. A host name may resolve to loopback (a
    127.0.1.1 line in /etc/hosts): then the address of the interface that routes to a peer."""
    own = peers.get(node) or socket.gethostbyname(node)
    if not own.startswith("127."):
        return own
    for address in peers.values():
        if address.startswith("127."):
            continue
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))  # no packet is sent: this only picks the route
            return probe.getsockname()[0]
    return own


class Supervisor:
    def __init__(self, command: list[str], run_dir: Path, slurm: SlurmClient | None = None,
                 on_requeue: Callable[[str], object] = lambda job_id: None, adoption: Adoption | None = None):
        self.command, self.run_dir, self.on_requeue, self.adoption = command, run_dir, on_requeue, adoption
        recipe = RunLayout(run_dir).read_spec().recipe
        self.watchdog = recipe.watchdog
        self.needed = recipe.resources.nodes
        self.slurm = slurm or CliSlurmClient()
        self.job_id = os.environ.get("SLURM_JOB_ID", "0")
        self.allocation = self.slurm.hostnames(os.environ["SLURM_JOB_NODELIST"])
        self.excluded: list[str] = []
        self.node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()  # the batch host
        self.peers = addresses(self.allocation)
        self.address = reachable_address(self.node, self.peers)
        # Heartbeats are heard only from the job's nodes (where all of them resolve).
        sources = set(self.peers.values()) | {self.address} if len(self.peers) == len(self.allocation) else None
        self.receiver = Receiver(job_secret(), sources=sources).listen()
        self.flood_said = False  # a flood is said once, not every half second
        self.slurm_answer: tuple[float, dict[str, bool]] = (float("-inf"), {})  # Slurm's word, when asked
        self.quiet_said = False  # many nodes quiet at once, Slurm saying they answer: said once
        self.process: subprocess.Popen | None = None
        self.warm: dict[str, subprocess.Popen] = {}  # node: its template's step
        self.spares_warm = False  # the spares' templates are started (once training has begun)
        self.lifting = False  # the helper that lifts Slurm's requeue hold is started (once)
        self.stopping = threading.Event()  # the time limit is near, or the job is ending: no restart
        self.for_good = False  # the run ended here for good (done, a user error, restarts spent)
        self.handing_back = False  # the job requeues itself (lost nodes) or fails at once
        self.err_seen = 0  # how much of srun.err (FT_LAUNCH_MARKS) earlier starts wrote
        self.auto_resume = any(arg.startswith("--auto-resume") for arg in command)  # HyperPod restarts itself
        self.marks = Path(os.environ["FT_LAUNCH_MARKS"]) if os.environ.get("FT_LAUNCH_MARKS") else None
        self.silence = SilenceRule(self.watchdog.heartbeat_timeout, self.slurmd_answers)
        self.slurmd_addresses = self.ask_node_addresses()
        self.slurmd_port = self.ask_slurmd_port()
        self.started_at = 0.0  # time.time() of the current start (its events are the ones after it)
        self.hangs: dict[str, int] = {}  # node: hangs blamed on it in this job
        self.listing = StepListing(self.slurm, self.job_id)  # the job's steps, for adopted ones
        if adoption is not None:
            self.excluded = self.left_out_before(adoption.lost)
            self.receiver.adopt_start(adoption.start)
        elif self.marks is not None:  # what a successor starts, should this batch host be lost
            with contextlib.suppress(OSError):
                (self.marks / STEP_COMMAND).write_text(json.dumps(command))

    def left_out_before(self, lost: str) -> list[str]:
        """A successor's: the nodes the lost batch host's supervisor left out (lost, drained, hung:
        marks/excluded.json), those Slurm took out of the job since, and the lost batch host."""
        left_out = []
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            left_out = [n for n in json.loads((self.marks / EXCLUDED).read_text()) if n in self.allocation]
        try:
            current = job_nodes(self.slurm, self.job_id) or self.allocation
        except FtError:
            current = self.allocation
        gone = [n for n in self.allocation if n not in current]
        return list(dict.fromkeys([*left_out, *gone, lost]))

    def ask_slurmd_port(self) -> int | None:
        """SlurmdPort, once (a Slurm that does not say: no probe, and no sign of loss from one)."""
        try:
            return self.slurm.config_number("SlurmdPort")
        except FtError:
            return None

    def ask_node_addresses(self) -> dict[str, str]:
        """Where each node's slurmd listens: Slurm's NodeAddr, else the name's address."""
        try:
            found = self.slurm.node_addresses(self.allocation)
        except FtError:
            found = {}
        return {node: found.get(node) or self.peers[node] for node in self.allocation
                if found.get(node) or node in self.peers}

    def slurmd_answers(self, node: str) -> bool:
        """Whether the node's slurmd takes a connection. A node with no known address, or a Slurm that
        does not say its SlurmdPort, gives no sign of loss: its silence waits for the timeout."""
        address = self.slurmd_addresses.get(node)
        if address is None or self.slurmd_port is None:
            return True
        return self.slurm.slurmd_answers(address, self.slurmd_port)

    def unstarted(self, nodes: list[str]) -> list[str]:
        """Nodes of the last start whose launcher never started: the step failed to launch there."""
        if self.marks is None:
            seen = self.receiver.seen()
            return [n for n in nodes if n not in seen]
        return [n for n in nodes if not (self.marks / n).exists()]

    # -- one start of the training ---------------------------------------------------------------
    def start(self, nodes: list[str]) -> subprocess.Popen:
        if self.warm and not self.warm_alive(nodes):  # a template gone (its node's step failed)
            self.start_warm(nodes)
        start = self.receiver.next_start()
        self.started_at = time.time()
        RunLayout(self.run_dir).clear_exit_status()
        for node in nodes:  # each launcher leaves its mark as it starts (toolkit/launch/node.py)
            with contextlib.suppress(FileNotFoundError, TypeError):
                (self.marks / node).unlink()
        env = dict(os.environ, MASTER_ADDR=nodes[0], MASTER_PORT=str(master_port(int(self.job_id), start)),
                   FT_WATCH_ADDR=self.address, FT_WATCH_PORT=str(self.receiver.port), FT_WATCH_START=str(start),
                   FT_WATCH_NODE=self.node, FT_WATCH_NODES=",".join(nodes),
                   FT_WATCH_TIMEOUT=str(self.watchdog.heartbeat_timeout),
                   FT_WATCH_SLURMD_PORT=str(self.slurmd_port or ""),
                   FT_WARM="1" if self.warm_alive(nodes) else "0")
        argv = steps.on_nodes(self.command, nodes)
        log(f"start {start}: training on {', '.join(nodes)}"
            + (f" (spare: {', '.join(self.spares())})" if self.spares() else ""))
        record(self.run_dir, "start", start=start, nodes=nodes, spares=self.spares())
        receipt_entries.attempt(self.run_dir, start, nodes, self.spares())
        self.err_seen = self.srun_errors_size()
        if self.marks is None:
            return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL)
        with open(self.marks / SRUN_ERRORS, "ab") as errors:  # read by launch_failed, and the job's lost_nodes
            return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stderr=errors)

    def take_over(self) -> tuple[AdoptedStep, list[str]]:
        """The training step the lost batch host started, watched as it runs; the launchers told
        where this supervisor listens (they wait for its word: toolkit/launch/handover.py)."""
        adoption, self.adoption = self.adoption, None
        self.started_at = time.time()
        self.err_seen = self.srun_errors_size()
        step = AdoptedStep(self.slurm, self.listing, adoption.step_id, adoption.nodes, self.goodbyes)
        Handover(adoption.lost, self.node, self.address, self.receiver.port).write(self.marks)
        log(f"took over from the lost batch host {adoption.lost}: training goes on on {', '.join(adoption.nodes)} "
            f"(step {adoption.step_id}, start {adoption.start})"
            + (f"; spare: {', '.join(self.spares())}" if self.spares() else "; no spare left"))
        record(self.run_dir, "took_over", lost=adoption.lost, node=self.node, step=adoption.step_id,
               start=adoption.start, spares=self.spares())
        return step, adoption.nodes

    def adopt_warm(self) -> None:
        """The templates the lost batch host started (one-node steps; their srun clients died with
        it) watched as this supervisor's own; the training step and this one's step aside."""
        steps_now = self.listing.steps_of_job() or {}
        own = f"{self.job_id}.{os.environ.get('SLURM_STEP_ID', '')}"
        training = self.adoption.step_id if self.adoption else ""
        for step_id, step_nodes in steps_now.items():
            if step_id not in (own, training) and len(step_nodes) == 1 and step_nodes[0] not in self.excluded:
                self.warm[step_nodes[0]] = AdoptedStep(self.slurm, self.listing, step_id, step_nodes)

    def goodbyes(self) -> dict[str, int]:
        """The exit codes the launchers of this start said as they ended."""
        return {node: seen.message["exit_code"] for node, seen in self.receiver.seen().items()
                if type(seen.message.get("exit_code")) is int}

    def srun_errors_size(self) -> int:
        try:
            return (self.marks / SRUN_ERRORS).stat().st_size if self.marks else 0
        except OSError:
            return 0

    def launch_failed(self) -> bool:
        """srun said this start could not launch on some node. It then only waits for the rest of
        the step (KillWait + 2 s; the lost node never answers) before exiting: the job,
        which judges the failure, need not wait with it while Slurm may find a lost node itself."""
        if self.marks is None or self.srun_errors_size() <= self.err_seen:
            return False
        try:
            with open(self.marks / SRUN_ERRORS, "rb") as errors:
                errors.seek(self.err_seen)
                return LAUNCH_FAILED in errors.read(1 << 20)
        except OSError:
            return False

    def watch(self, process: subprocess.Popen, nodes: list[str]) -> Outcome:
        began, reported, drain_checked = time.monotonic(), False, time.monotonic()
        timeout, startup = self.watchdog.heartbeat_timeout, self.watchdog.startup_timeout
        while True:
            time.sleep(WATCH_EVERY_S)
            now = time.monotonic()
            code = process.poll()
            if code is not None:
                return self.ended(code, nodes)
            if self.launch_failed() and self.unstarted(nodes):
                log("the step did not launch on every node: not waiting for srun to say so")
                process.kill()
                process.wait()
                return self.ended(1, nodes)
            if self.stopping.is_set():
                continue
            if self.warm and not self.spares_warm and self.training_began():
                self.spares_warm = True
                self.start_warm()
            lost = self.silent_lost(nodes, now, timeout, now - began > startup)
            if lost is None and now - drain_checked > DRAIN_CHECK_S and not self.auto_resume:
                drain_checked = now
                drained = self.drained(nodes)
                if drained:
                    why = "drained: " + "; ".join(f"{node}: {reason}" for node, reason in sorted(drained.items()))
                    lost = Lost(sorted(drained), why, drained=True)
            if lost and self.auto_resume:
                if not reported:
                    log(f"{lost.why} on {', '.join(lost.nodes)}: left to HyperPod's --auto-resume")
                    record(self.run_dir, "node_silent", nodes=lost.nodes, left_to="auto-resume")
                reported = True
            elif lost and lost.drained:
                log(f"{lost.why} ({', '.join(lost.nodes)}): stopping the step after a checkpoint")
                self.stop_step(process, checkpoint_first=True)
                return Outcome(None, lost)
            elif lost:
                # A silent node first marked DOWN: Slurm then ends the step's part there, and srun
                # waits for nothing that will never answer; the survivors' ranks are killed (they
                # would wait on the lost one's collectives) and the next start goes on at once.
                log(f"{lost.why} ({', '.join(lost.nodes)}): stopping the step")
                self.receiver.tell_lost(lost.nodes)
                self.exclude(lost)
                self.stop_step(process, grace=LOST_STOP_GRACE_S)
                return Outcome(None, lost)

    def silent_lost(self, nodes: list[str], now: float, timeout: float, started_late: bool) -> Lost | None:
        """The nodes lost by their silence (toolkit/watch/silence.py), and those never heard from
        within the startup timeout. Silence for the whole timeout under a flood of datagrams is
        asked about once more (flood_checked): the kernel drops real heartbeats in a flood."""
        seen = self.receiver.seen()
        quiet = {node: now - seen[node].last for node in self.silent(seen, nodes, now, 0)}
        judged = self.silence.lost(quiet, len(nodes))
        late = [n for n in judged if quiet[n] >= timeout]
        if SilenceRule.many(len(late), len(nodes)):  # this host's own network, more likely: Slurm's word
            late = self.slurm_confirms(late, f"{len(late)} of {len(nodes)} nodes quiet at once")
        late = self.flood_checked(late, timeout)
        lost = {node: why for node, why in judged.items() if quiet[node] < timeout or node in late}
        lost.update({n: "never heard from since the start" for n in nodes if n not in seen and started_late})
        if not lost:
            return None
        return Lost(sorted(lost), "; ".join(sorted(set(lost.values()))))

    def slurm_confirms(self, silent: list[str], why: str) -> list[str]:
        """The nodes among these whose slurmd Slurm says does not answer it either."""
        answer = self.slurm_unanswering(silent)
        if answer is None:
            return silent
        kept = [node for node in silent if not answer[node]]
        if kept and not self.quiet_said:
            log(f"{why}: Slurm says {', '.join(kept)} answer, so they are not taken as lost")
        self.quiet_said = bool(kept)
        return [node for node in silent if answer[node]]

    def slurm_unanswering(self, silent: list[str]) -> dict[str, bool] | None:
        """Slurm's word on each node: True where its slurmd does not answer Slurm either. Asked at most
        every DRAIN_CHECK_S (a silence that lasts must not become a flood of sinfo, one each watch
        beat); None where Slurm cannot be asked."""
        asked, answer = self.slurm_answer
        if time.monotonic() - asked > DRAIN_CHECK_S or not set(silent) <= set(answer):
            try:
                unanswering = set(self.slurm.unresponsive(silent))
            except FtError as exc:
                log(f"could not ask Slurm about {', '.join(silent)} ({exc.message}): taken as lost")
                return None
            answer = {node: node in unanswering for node in silent}
            self.slurm_answer = (time.monotonic(), answer)
        return answer

    def ended(self, code: int, nodes: list[str]) -> Outcome:
        """srun is done. After a failure, a node that said no goodbye was lost where its slurmd does
        not answer (a crash ends the other nodes' collectives at once: the step may end before the
        node's silence is long enough to judge), or where it was already quiet for SILENT_AT_END_S
        when srun ended. Not one that srun's own stop killed as it ended (it had no time
        to say goodbye, but its slurmd answers), nor any node of a step that did not
        launch everywhere (the job judges those, from srun's messages). A success, a
        user error or a requested stop is what it says, whatever the heartbeats."""
        if code:  # the code of whichever rank or launcher ended the step, not srun's (exits.py)
            code = RunLayout(self.run_dir).read_exit_status() or code
        if code == 0 or code in exits.NOT_RESTARTED or self.auto_resume or self.stopping.is_set() \
                or self.unstarted(nodes):
            return Outcome(code, None)
        seen, now = self.receiver.seen(), time.monotonic()
        quiet = self.silent(seen, nodes, now, SILENT_AT_END_S)
        if quiet:
            return Outcome(code, Lost(quiet, f"no heartbeat for {SILENT_AT_END_S:.0f} s before the step ended"))
        unsaid = self.silent(seen, nodes, now, 0)
        if SilenceRule.many(len(unsaid), len(nodes)):  # a step ended together: srun's own stop, not crashes
            return Outcome(code, None)
        gone = [node for node, answered in zip(unsaid, self.silence.probe_all(unsaid), strict=True) if not answered]
        return Outcome(code, Lost(gone, "no goodbye as the step ended, and its slurmd does not answer")
                       if gone else None)

    def flood_checked(self, silent: list[str], timeout: float) -> list[str]:
        """Nodes gone silent while the receiver refused a flood of datagrams (FLOOD_DATAGRAMS or more
        within the timeout: the kernel drops real heartbeats in it too) are lost only where Slurm
        says their slurmd does not answer either. Slurm's own timeout is slower, but a flood must not
        stop a healthy run. Said once per flood, with the addresses that sent the most."""
        if not silent:
            return silent
        refused, sources = self.receiver.flood(timeout)
        if refused < FLOOD_DATAGRAMS:
            self.flood_said = False
            return silent
        answer = self.slurm_unanswering(silent)
        if answer is None:
            return silent
        confirmed = [node for node in silent if answer[node]]
        kept = sorted(set(silent) - set(confirmed))
        if kept and not self.flood_said:
            self.flood_said = True
            log(f"heartbeats of {', '.join(kept)} silent under a flood of {refused} datagrams in {timeout:.0f} s "
                f"(mostly from {', '.join(sources) or 'unknown'}): Slurm says their slurmd answers, so they are not "
                "taken as lost")
            record(self.run_dir, "heartbeat_flood", refused=refused, sources=sources, silent=kept)
        return confirmed

    @staticmethod
    def silent(seen: dict, nodes: list[str], now: float, limit: float) -> list[str]:
        """Nodes heard from before that went quiet, without saying goodbye."""
        return [node for node in nodes if node in seen and "exit_code" not in seen[node].message
                and now - seen[node].last > limit]

    def drained(self, nodes: list[str]) -> dict[str, str]:
        try:
            return self.slurm.drained(nodes)
        except FtError as exc:  # Slurm slow or away: no news is taken as good news, and logged
            log(f"could not check the nodes' state ({exc.message}); checking again in {DRAIN_CHECK_S:.0f} s")
            return {}

    def stop_step(self, process: subprocess.Popen, checkpoint_first: bool = False,
                  grace: float = STOP_GRACE_S) -> None:
        """srun ends a step on two interrupts within a second; it is killed if it does not. A node
        drained under the job is sound for now: the ranks checkpoint first (USR2), within reason."""
        if checkpoint_first and process.poll() is None:
            process.send_signal(signal.SIGUSR2)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=min(CHECKPOINT_GRACE_S, self.watchdog.startup_timeout))
        for _ in range(2):
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
                time.sleep(0.3)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    # -- decisions --------------------------------------------------------------------------------
    def usable(self) -> list[str]:
        """The allocation's nodes left, in the order they are taken: the batch host last. Its loss
        costs a requeue whatever the spares (the job dies with it), so it waits as the last
        spare while there are others: a node that trains is the likelier to fail (GPU faults come
        under load), and a lost node that trained is replaced inside the job."""
        left = [n for n in self.allocation if n not in self.excluded]
        return [n for n in left if n != self.node] + [n for n in left if n == self.node]

    def placement(self) -> list[str]:
        """The nodes the next start trains on, in the allocation's order: srun numbers a step's
        tasks in that order, whatever --nodelist says, and task 0's node is the rendezvous."""
        chosen = set(self.usable()[:self.needed])
        return [n for n in self.allocation if n in chosen]

    def spares(self) -> list[str]:
        return self.usable()[self.needed:]

    def exclude(self, lost: Lost) -> None:
        fresh = [node for node in lost.nodes if node not in self.excluded and node in self.allocation]
        self.excluded += fresh
        if fresh and self.marks is not None:  # a successor, should this node be lost, leaves them out too
            with contextlib.suppress(OSError):
                (self.marks / EXCLUDED).write_text(json.dumps(self.excluded))
        self.stop_warm(fresh)  # a drained node's template would hold its memory for nothing
        if fresh and len(self.allocation) - len(self.excluded) < self.needed:
            self.requeue_soon()  # before a node is marked DOWN: Slurm may requeue the job at that
        for node in fresh:
            if lost.drained:  # someone else took it out, with their reason: left as it is
                log(f"node {node} left out: {lost.why}")
                record(self.run_dir, "node_lost", node=node, reason=lost.why, marked_down=False)
                continue
            reason = f"ft: {lost.why} (run {os.environ.get('FT_RUN_ID', '?')}, job {self.job_id})"
            if lost.hung:  # alive: drained, so that no job lands on it until an admin looks
                try:
                    drained = self.slurm.drain_node(node, reason)
                except FtError:
                    drained = False
                log(f"node {node} {'drained' if drained else 'left out (draining it needs operator rights)'}: "
                    f"{lost.why}")
                record(self.run_dir, "node_lost", node=node, reason=lost.why, marked_down=False,
                       drained_by_ft=drained)
                continue
            try:
                marked = self.slurm.mark_node_down(node, reason)
            except FtError:
                marked = False
            if marked:
                keep_down(self.slurm, node, reason, lambda node=node: not self.slurmd_answers(node), log)
            log(f"node {node} {'marked DOWN' if marked else 'left out (marking it DOWN needs operator rights)'}: "
                f"{lost.why}")
            record(self.run_dir, "node_lost", node=node, reason=lost.why, marked_down=marked)

    def hung_too_often(self, nodes: list[str]) -> Lost | None:
        """The nodes this start's hang is blamed on (toolkit/launch/workers.py's rank_hung events),
        counted; those blamed watchdog.exclude_after_hangs times are left out. A hang that blames
        no node (every hung rank may be waiting on another), or every node at once (a shared
        filesystem that stalls everyone's I/O), restarts on the same nodes."""
        blamed: dict[str, str] = {}
        for event in read_lines(RunLayout(self.run_dir).events,
                                {"event": str, "node": str, "start": int, "time": (int, float)}):
            if event["event"] == "rank_hung" and event.get("job") == self.job_id and event.get("blamed") \
                    and event["start"] == self.receiver.start_number and event["time"] >= self.started_at \
                    and event["node"] in nodes:
                blamed.setdefault(event["node"], f"rank {event.get('rank', '?')} {event['blamed']}")
        if not blamed or (len(nodes) > 1 and set(blamed) == set(nodes)):
            log("the hang blames no one node (" + ("each hung rank may be waiting on another" if not blamed else
                                                   "every node's ranks hang alike") + "): the same nodes again")
            return None
        bound, over = self.watchdog.exclude_after_hangs, []
        for node, why in sorted(blamed.items()):
            self.hangs[node] = self.hangs.get(node, 0) + 1
            if self.hangs[node] >= bound:
                over.append(node)
            else:
                log(f"hang {self.hangs[node]} of {bound} blamed on {node} ({why}) before it is left out")
        if not over:
            return None
        return Lost(over, "; ".join(f"hung {self.hangs[node]} times, last: {blamed[node]}" for node in over), hung=True)

    def record_gaps(self) -> None:
        """The longest wait between two heartbeats of each node in this start: how close the run
        came to silence.QUIET_S (benchmarks/false_alarms.py reads them)."""
        gaps = {node: round(seen.longest_gap, 3) for node, seen in self.receiver.seen().items()}
        if gaps:
            record(self.run_dir, "heartbeat_gaps", longest=gaps)

    def finished(self) -> bool:
        return RunLayout(self.run_dir).done.exists()

    def end(self, code: int, **why) -> int:
        """The supervisor's own verdict: what the job reads (an older rank's exit-status
        must not override it)."""
        RunLayout(self.run_dir).clear_exit_status()
        if code:
            RunLayout(self.run_dir).leave_exit_status(code)
        self.record_end(code, **why)
        return code

    def record_end(self, code: int | None, **why) -> None:
        """A start's end in the timeline and the receipt (sealed: what the job did so far is signed
        while the job still runs)."""
        record(self.run_dir, "end", code=code, **why)
        receipt_entries.attempt_ended(self.run_dir, code, str(why.get("why")) if why.get("why") else None)

    # -- the warm templates -------------------------------------------------------------------------
    def start_warm(self, nodes: list[str] | None = None) -> None:
        """A template on each node named (default: every node of the allocation left, spares
        included) that has none running (toolkit/launch/warm.py), each in its own step: a restart,
        here or on a spare, forks its ranks from it. The start after a template was started again
        waits for its imports, as a cold start would."""
        if self.auto_resume:  # HyperPod restarts the step itself, with new processes
            return
        layout = RunLayout(self.run_dir)
        nodes = [n for n in (nodes or self.allocation) if n not in self.excluded and not self.warm_alive([n])]
        started = []
        for node in nodes:
            argv = warm_command(self.command, node, str(layout.warm_log("%N")))
            if argv is None:
                return
            layout.logs.mkdir(exist_ok=True)
            with open(layout.warm_srun_errors, "a") as errors:
                self.warm[node] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=errors)
            started.append(node)
        if started:
            log(f"warm templates of the training runtime starting on {', '.join(started)}")

    def warm_alive(self, nodes: list[str]) -> bool:
        return bool(nodes) and all(n in self.warm and self.warm[n].poll() is None for n in nodes)

    def stop_warm(self, nodes: list[str] | None = None, wait: bool = True) -> None:
        """TERM to the templates' steps of the nodes named, or to all of them and then waited for (at
        most STOP_GRACE_S altogether, then killed) as the supervisor ends, unless `wait` is False."""
        stopping = [self.warm[n] for n in (nodes if nodes is not None else self.warm) if n in self.warm]
        for process in stopping:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        if nodes is not None or not wait:
            return
        deadline = time.monotonic() + STOP_GRACE_S
        for process in stopping:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def training_began(self) -> bool:
        """Whether a rank reported a step done (the launchers' heartbeats carry their ranks' steps)."""
        for seen in self.receiver.seen().values():
            ranks = seen.message.get("ranks")
            if isinstance(ranks, dict) and any(isinstance(place, list) and len(place) == 2 and type(place[1]) is int
                                               and place[1] > 0 for place in ranks.values()):
                return True
        return False

    def run(self) -> int:
        # The spares' templates once training has begun: they are wanted at a restart only, and
        # nodes importing the runtime at once from a shared filesystem (Lustre's metadata servers)
        # slow the first start of every node.
        if self.adoption is not None:
            self.adopt_warm()
        self.start_warm(self.placement())
        exporter = self.start_exporter()
        code = None
        try:
            code = self.attempts()
            return code
        finally:
            # Not waited for when the job is handed back to be requeued (Slurm ends what is left of
            # it): before Slurm finds a node lost at launch by itself, ft marks it down with its
            # reason and lifts the requeue hold. An out-of-memory retry starts new templates on the
            # same nodes: the old ones are waited for.
            self.stop_warm(wait=not self.handing_back)
            if exporter is not None:
                # One last scrape at the run's end only (finished, or failed for good): never while
                # the job has more to do at once (requeue without a node lost at launch before
                # Slurm notices it, retry out of memory) nor while Slurm is stopping the job (its
                # grace is the checkpoint's).
                last = self.for_good and not self.stopping.is_set()
                with contextlib.suppress(Exception):  # monitoring never changes the exit code
                    exporter.stop(final_wait_s=None if last else 0)

    def heartbeat_messages(self) -> dict[str, dict]:
        """Each node's launcher's newest heartbeat: its ranks' phases, its GPUs (metrics.py reads them)."""
        return {node: seen.message for node, seen in self.receiver.seen().items()}

    def heartbeat_ages(self) -> dict[str, float]:
        now = time.monotonic()
        return {node: round(now - seen.last, 3) for node, seen in self.receiver.seen().items()}

    def start_exporter(self):
        """The run's Prometheus metrics (toolkit/watch/metrics.py); a run goes on without them."""
        try:
            from toolkit.watch.metrics import RunExporter

            exporter = RunExporter(self.run_dir, self.heartbeat_ages, host=self.node, messages=self.heartbeat_messages)
            log(f"metrics for Prometheus on {self.node}:{exporter.start()}/metrics")
            return exporter
        except Exception as exc:  # noqa: BLE001 - no prometheus_client, no port: monitoring is not worth a failed run
            log(f"no Prometheus metrics for this run: {type(exc).__name__}: {exc}")
            return None

    def attempts(self) -> int:
        restarts, most = 0, self.watchdog.max_restarts
        while True:
            if self.finished():  # a failure after the run's end (an upload, say) never reruns it
                self.for_good = True
                return self.end(0, why="the run had finished")
            if self.stopping.is_set():
                return self.end(exits.STOPPED, why="stopped before a new start")
            if self.adoption is not None:
                self.process, nodes = self.take_over()
            else:
                nodes = self.placement()
                if len(nodes) < self.needed:
                    return self.hand_back_lost()
                self.process = self.start(nodes)
            if self.stopping.is_set():  # the signal came while srun was starting: pass it on now
                self.process.send_signal(signal.SIGUSR2)
            outcome = self.watch(self.process, nodes)
            self.record_gaps()
            if outcome.code == exits.HUNG and outcome.lost is None and not self.stopping.is_set():
                outcome.lost = self.hung_too_often(nodes)
            if outcome.lost and not self.stopping.is_set():
                self.exclude(outcome.lost)
            elif outcome.code == 0 or self.stopping.is_set() or self.auto_resume or outcome.code in exits.NOT_RESTARTED:
                # Out of memory is the job's to retry, a stop the next job's to resume.
                self.for_good = outcome.code in (exits.DONE, exits.USER_ERROR) and not self.stopping.is_set()
                self.record_end(outcome.code)
                return outcome.code if outcome.code is not None else 1
            elif self.unstarted(nodes):  # a node lost at step launch, or refused it: the job's to judge
                self.handing_back = True
                self.record_end(outcome.code, why="the step did not start on every node",
                       nodes=self.unstarted(nodes))
                return outcome.code
            if self.finished():
                self.for_good = True
                return self.end(0, why="the run had finished")
            restarts += 1
            if restarts > most:
                log(f"{most} restarts in this job already: giving up (watchdog.max_restarts)")
                self.for_good = True
                return self.end(outcome.code or 1, why="max_restarts")
            # The first restart at once (most faults are one-off); a fault that keeps coming back
            # waits longer each time, so that a broken node or filesystem is not hammered.
            pause = 0 if outcome.lost else min(2 ** (restarts - 1) - 1, 30)
            log(f"restart {restarts} of at most {most}"
                + (f" in {pause} s" if pause else "") + ": training resumes from the latest checkpoint")
            record(self.run_dir, "restart", restart=restarts, after=("node_lost" if outcome.lost else
                                                                     f"exit {outcome.code}"))
            self.stopping.wait(pause)  # a signal in the pause is not lost: the loop looks first

    def requeue_soon(self) -> None:
        """No spare left: the job is about to be requeued (by Slurm, for a node marked DOWN, or by
        the job itself), and everything of it killed: the job lifts Slurm's requeue hold as it ends
        (`on_requeue`: toolkit/job/controller.py's expect_requeue), so that it starts again at once."""
        if not self.lifting and not self.auto_resume:
            self.on_requeue(self.job_id)
            self.lifting = True

    def hand_back_lost(self) -> int:
        """No spare left: the job requeues itself without the lost nodes (`excluded`)."""
        self.requeue_soon()
        log(f"no spare node left for {', '.join(self.excluded)}: the job requeues without them")
        self.handing_back = True
        return self.end(exits.NODES_LOST, why="no spare node left", lost=self.excluded)

    def close(self) -> None:
        """Its heartbeat socket closed: a retry out of memory starts another supervisor."""
        self.receiver.close()

    def on_signal(self, signum, _frame) -> None:
        """USR2 (time limit near) and TERM (the job ends): passed on to the step; no restart after."""
        self.stopping.set()
        # returncode, not poll(): a handler must not wait on a lock its own thread may hold (an
        # adopted step's poll reads the heartbeats), nor on Slurm.
        if self.process and self.process.returncode is None:
            self.process.send_signal(signum)


def main(argv: list[str]) -> int:
    """What a job script rendered by an older ft runs (`python -m toolkit.watch.supervise -- srun ...`,
    which toolkit/watch/supervise.py hands here; its requeue logic in bash): a job requeued across an
    upgrade of ft reruns the script it was submitted with. The supervisor as it was then; the lost
    nodes for that script in FT_LAUNCH_MARKS/lost-nodes. New scripts run the job itself (python -m
    toolkit.job)."""
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print("usage: python -m toolkit.watch.supervise -- srun [options] COMMAND", file=sys.stderr)
        return 2
    log("this job script was rendered by an older ft: it runs as it did then; render it again (ft render) for "
        "the job controller (toolkit/job)")
    run_dir = Path(os.environ["FT_RUN_DIR"])
    try:
        supervisor = Supervisor(argv[argv.index("--") + 1:], run_dir)
    except RunSpecError as exc:
        print(f"ft-watch: {exc}", file=sys.stderr, flush=True)
        RunLayout(run_dir).leave_exit_status(exits.USER_ERROR)
        return exits.USER_ERROR
    signal.signal(signal.SIGUSR2, supervisor.on_signal)
    signal.signal(signal.SIGTERM, supervisor.on_signal)
    code = supervisor.run()
    if code == exits.NODES_LOST and supervisor.marks is not None:
        (supervisor.marks / LOST_NODES).write_text("\n".join(supervisor.excluded) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
