"""The cluster's metrics for Prometheus: its nodes (serving, drained and why, down) and its queues per
service tier (pending and running jobs, the oldest pending job's wait), read from Slurm's own tools
at scrape time (at most every CACHE_S seconds: a scrape never floods slurmctld).

    python -m toolkit.services.cluster_metrics [--listen 127.0.0.1] [--port 9797] [--cluster NAME]

runs on the controller (ansible/roles/prometheus starts it); Prometheus scrapes it as job ft-cluster.

    ft_node_up{node}                                   1 when the node can run jobs
    ft_node_drained{node}                              1 when drained or draining
    ft_node_drain_reason_info{node, reason}            1 while drained, with Slurm's reason
    ft_queue_pending_jobs{partition, tier}             jobs waiting
    ft_queue_running_jobs{partition, tier}             jobs running
    ft_queue_oldest_pending_seconds{partition, tier}   the longest wait for nodes, since eligible
    ft_cluster_slurm_up                                1 when Slurm answered the last scrape
"""

from __future__ import annotations

import argparse
import os
import pwd
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from toolkit.base.errors import FtError
from toolkit.base.privileges import drop_privileges
from toolkit.cluster.profile import load_profile
from toolkit.services import run_targets
from toolkit.slurm import commands
from toolkit.slurm import jobs as slurm_jobs
from toolkit.slurm import nodes as slurm_nodes
from toolkit.slurm.jobs import QueueLine
from toolkit.slurm.nodes import NodeState

CACHE_S = 10.0
PUBLISH_EVERY_S = 1.0  # how often the runs' claims folder is listed (a listing, not a Slurm call)
# Why a pending job waits, when it is the cluster's doing: the premium tier's promise is about these
# only (not a job held, waiting on a dependency or a begin time, or on its user's own limits).
WAITING_ON_THE_CLUSTER = {"Priority", "Resources"}
COMMAND_TIMEOUT_S = 4.0  # both commands within Prometheus's 10 s scrape timeout: a hung slurmctld reads as down


class ClusterCollector:
    def __init__(self, tiers: dict[str, str], run: Callable = commands.run, now: Callable[[], float] = time.time):
        self.tiers = tiers  # partition -> tier, from the cluster profile
        self.run, self.now = run, now
        self.cached: tuple[float, dict[str, NodeState], list[QueueLine], bool] = (float("-inf"), {}, [], False)
        self.lock = threading.Lock()

    def read(self) -> tuple[dict[str, NodeState], list[QueueLine], bool]:
        with self.lock:
            taken, nodes, jobs, answered = self.cached
            if time.monotonic() - taken >= CACHE_S:
                try:
                    nodes = slurm_nodes.node_states(self.run, timeout=COMMAND_TIMEOUT_S)
                    jobs = slurm_jobs.queue_lines(self.run, timeout=COMMAND_TIMEOUT_S)
                    answered = True
                except FtError:  # the controller does not answer: say so, keep no stale numbers
                    nodes, jobs, answered = {}, [], False
                self.cached = (time.monotonic(), nodes, jobs, answered)
            return nodes, jobs, answered

    def collect(self) -> Iterator:
        from prometheus_client.core import GaugeMetricFamily

        nodes, jobs, answered = self.read()
        slurm_up = GaugeMetricFamily("ft_cluster_slurm_up", "1 when Slurm answered the last scrape")
        slurm_up.add_metric([], 1.0 if answered else 0.0)
        yield slurm_up
        up = GaugeMetricFamily("ft_node_up", "1 when the node can run jobs", labels=["node"])
        drained = GaugeMetricFamily("ft_node_drained", "1 when the node is drained or draining", labels=["node"])
        # The reason apart, and only while drained: a reason that changes (a health check's counts)
        # would otherwise start a new ft_node_drained series, and restart its alert's clock.
        reasons = GaugeMetricFamily("ft_node_drain_reason_info", "Why a drained node is drained (value 1)",
                                    labels=["node", "reason"])
        for node in sorted(nodes.values(), key=lambda n: n.name):
            up.add_metric([node.name], 1.0 if node.up else 0.0)
            drained.add_metric([node.name], 1.0 if node.drained else 0.0)
            if node.drained:
                reasons.add_metric([node.name, node.reason], 1.0)
        yield up
        yield drained
        yield reasons
        labels = ["partition", "tier"]
        pending = GaugeMetricFamily("ft_queue_pending_jobs", "Jobs waiting, per partition", labels=labels)
        running = GaugeMetricFamily("ft_queue_running_jobs", "Jobs running, per partition", labels=labels)
        oldest = GaugeMetricFamily("ft_queue_oldest_pending_seconds",
                                   "How long the longest-waiting job has waited for nodes (Priority or "
                                   "Resources), since it became eligible", labels=labels)
        now = self.now()
        for partition in sorted(set(self.tiers) | {job.partition for job in jobs}):
            key = [partition, self.tiers.get(partition, "")]
            waiting = [job for job in jobs if job.partition == partition and job.state == "PENDING"]
            pending.add_metric(key, len(waiting))
            running.add_metric(key, sum(job.partition == partition and job.state == "RUNNING" for job in jobs))
            eligible = [job.eligible for job in waiting if job.eligible is not None
                        and job.reason in WAITING_ON_THE_CLUSTER]
            oldest.add_metric(key, max(now - min(eligible), 0.0) if eligible else 0.0)
        yield from (pending, running, oldest)


class RunPublisher:
    """Publishes the runs' claims Slurm vouches for (toolkit/services/run_targets.py), in its own thread:
    the claims folder is listed every PUBLISH_EVERY_S, Slurm asked when it changed (a run appears
    within seconds) and at least every CACHE_S (a run that ended goes)."""

    def __init__(self, claims: Path, published: Path, run: Callable = commands.run):
        self.claims, self.published, self.run = claims, published, run
        self.seen: int | None = None  # the claims folder's change time at the last turn
        self.asked = float("-inf")
        self.refused: dict[str, str] = {}  # claim -> why, said once (forgotten once the claim is gone)
        # (job, run) -> why its batch script is not ft's for that run (a job's script never changes; its
        # comment, which names the run, may)
        self.scripts: dict[tuple[str, str], str | None] = {}

    def once(self) -> None:
        # Watchdogs write claims whole under a new name and rename them: the folder's own change time
        # says whether anything changed, at the cost of one stat however many files it holds.
        try:
            listing = self.claims.stat().st_mtime_ns
        except OSError:
            listing = None
        if listing == self.seen and time.monotonic() - self.asked < CACHE_S:
            return
        try:
            jobs = run_targets.running_ft_jobs(self.run, timeout=COMMAND_TIMEOUT_S)
        except FtError:
            return  # Slurm silent: what was published stays until it answers again
        self.seen, self.asked = listing, time.monotonic()
        self.scripts = {key: why for key, why in self.scripts.items() if key[0] in jobs}
        groups, refusals = run_targets.verified_targets(self.claims, jobs, self.script_problem)
        refused = {refusal.claim: refusal.why for refusal in refusals}
        for claim, why in refused.items():
            if self.refused.get(claim) != why:  # names and reasons are the claim maker's: repr, one line
                print(f"not published: {str(self.claims / claim)!r}: {why!r}", flush=True)
        self.refused = refused
        run_targets.publish(self.published, groups)

    def script_problem(self, job: run_targets.RunningJob) -> str | None:
        """Why the job's batch script is not ft's for its run (None: it is), asked of Slurm once a job."""
        key = (job.job_id, job.run)
        if key not in self.scripts:
            script = slurm_jobs.batch_script(job.job_id, self.run, timeout=COMMAND_TIMEOUT_S)
            self.scripts[key] = run_targets.script_problem(script, job.run)
        return self.scripts[key]

    def forever(self, stopped: threading.Event) -> None:
        while True:
            try:
                self.once()
            except Exception as error:  # noqa: BLE001 - a bad turn must not end the publishing for good
                print(f"publishing the runs' targets failed: {error!r}", flush=True)
            if stopped.wait(PUBLISH_EVERY_S):
                return


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit.services.cluster_metrics",
                                     description="Serve the cluster's metrics for Prometheus, and publish "
                                                 "the runs' targets Slurm vouches for.")
    parser.add_argument("--listen", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9797)
    parser.add_argument("--cluster", default=None, help="cluster profile whose tiers name the partitions")
    parser.add_argument("--publish", type=Path, default=None,
                        help="folder (the exporter's own) for the runs' targets Prometheus reads")
    parser.add_argument("--user", default=None, help="started as root: become this user once serving")
    options = parser.parse_args(argv)
    from prometheus_client import CollectorRegistry, start_http_server

    profile = load_profile(options.cluster or None)
    tiers = {target.partition: tier for tier, target in profile.tiers.items()}
    registry = CollectorRegistry()
    registry.register(ClusterCollector(tiers))
    server, _ = start_http_server(options.port, addr=options.listen, registry=registry)
    address = f"{options.listen}:{server.server_port}"
    publisher = None
    if options.publish is not None and profile.shared_root:
        publisher = RunPublisher(Path(profile.shared_root) / "monitoring" / "targets", options.publish)
    # One whole scrape before dropping root: every module a scrape uses is loaded while ft's Python
    # can still be read (the publisher's are imported with this module).
    urllib.request.urlopen(f"http://{address}/metrics", timeout=30).read()
    if options.user:
        drop_privileges(options.user)
    if publisher is not None and not os.access(options.publish, os.W_OK | os.X_OK):
        raise SystemExit(f"{options.publish} is not a folder this exporter can write (as user "
                         f"{pwd.getpwuid(os.getuid()).pw_name}): make it (ansible/roles/prometheus does) and "
                         "give it to that user")
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    if publisher is not None:
        threading.Thread(target=publisher.forever, args=(stopped,), name="ft-run-targets", daemon=True).start()
    print(f"ft cluster metrics on {address}/metrics" + (f", as {options.user}" if options.user else "")
          + (f"; runs' targets published in {options.publish}" if publisher else ""), flush=True)
    while not stopped.wait(1.0):
        pass
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
