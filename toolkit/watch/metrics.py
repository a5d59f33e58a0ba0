"""A run's Prometheus metrics, served by its supervisor on the batch host (prometheus_client).

Nothing here runs in the training loop: each scrape reads what the run already writes (rank 0's
metrics.jsonl, the checkpoint status, the timeline) and what the supervisor already knows (the
nodes' heartbeats). A scrape costs the ranks nothing, whatever its interval.

How Prometheus finds a run (jobs come and go, on whichever batch host Slurm picks): file-based
service discovery. The supervisor writes a claim, <shared root>/monitoring/targets/<run>.<job>.json,
when it starts serving and removes it when it ends; the cluster exporter publishes the claims Slurm
vouches for, labelled with Slurm's word (run, user, slurm_job: toolkit/services/run_targets.py), and
Prometheus reads what it published (file_sd_configs, ansible/roles/prometheus). A pull keeps
Prometheus's own `up` and staleness semantics (a push gateway would keep serving a dead run's last
values), and needs no agent beside the job (a textfile collector needs node_exporter on every
compute node and a shared clock for freshness).

Every series below also carries the target's labels run, user and slurm_job, which Prometheus adds:
the exporter serves none of them itself (what a user's process serves is not proof of who it is).
Prometheus scrapes each scope apart (scoped_app): the run's own series, and each node's, whose
`node` label is then Slurm's name for a node the job holds (toolkit/services/run_targets.py).

    ft_run_info{recipe, method, tier, cluster}  1
    ft_run_step, ft_run_loss, ft_run_learning_rate                 the newest step's
    ft_run_tokens_per_second, ft_run_step_seconds                  over the last WINDOW steps
    ft_run_last_step_timestamp_seconds                             when the newest step ended
    ft_run_tokens_total                                            tokens trained on
    ft_run_restarts_total                                          starts after the first
    ft_run_goodput_ratio                                           productive time / wall time
    ft_run_checkpoint_step{tier}                                   newest checkpoint per tier
    ft_run_checkpoint_upload_lag_seconds                           since the oldest one not mirrored
    ft_run_checkpoint_upload_failing                               1 while uploads fail
    ft_node_heartbeat_age_seconds{node}                            since a node's launcher was heard
    ft_run_ranks{phase}                                            ranks loading, stepping, saving, exporting,
                                                                   evaluating
    ft_gpu_*{node, gpu}                                            NVML's readings (toolkit/watch/gpus.py)
    ft_run_eval_loss{model, split}, ft_run_eval_metric{model, metric}  after training (eval.json)
    ft_run_eval_gate_passed{gate}, ft_run_eval_promoted                the gates and the verdict
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from toolkit.runs.layout import RunLayout
from toolkit.runs.progress import WINDOW, number, read_progress
from toolkit.runs.status import read_json

PHASES = ("start", "step", "save", "export", "eval")  # toolkit/watch/progress.py's, and "start" before them

GOODPUT_EVERY_S = 60.0  # the timeline reads whole files: not at every scrape


class RunCollector:
    """prometheus_client's custom-collector protocol: `collect()` yields metric families, read at
    scrape time."""

    def __init__(self, run_dir: Path, labels: dict[str, str], heartbeats: Callable[[], dict[str, float]],
                 messages: Callable[[], dict[str, dict]] = dict):
        self.run_dir, self.layout = run_dir, RunLayout(run_dir)
        self.labels = labels
        self.heartbeats = heartbeats  # node -> seconds since heard
        self.messages = messages  # node -> its launcher's newest heartbeat (ranks' phases, GPUs)
        self.goodput: tuple[float, dict | None] = (0.0, None)
        self.reported: set[str] = set()  # what a damaged file made us leave out, said once

    def collect(self, scope: str | None = None) -> Iterator:
        """Every family; with a scope (scoped_app), only the sections that can hold its series: a
        node's scrape reads no run file, the run's reads no node's state."""
        from prometheus_client.core import GaugeMetricFamily

        names, values = list(self.labels), list(self.labels.values())

        def gauge(name: str, documentation: str, value: float | None, extra: dict | None = None):
            if value is None:
                return None
            family = GaugeMetricFamily(name, documentation, labels=names + list(extra or {}))
            family.add_metric(values + list((extra or {}).values()), value)
            return family

        per_node = [self.heartbeat_metrics, self.gpu_metrics]
        per_run = [lambda: self.step_metrics(gauge), lambda: self.checkpoint_metrics(gauge),
                   lambda: self.goodput_metrics(gauge), self.restart_metrics, self.phase_metrics, self.eval_metrics]
        if scope != "node":
            info = GaugeMetricFamily("ft_run_info", "The run (value 1), its recipe and where it runs", labels=names)
            info.add_metric(values, 1)
            yield info
        for section in {"node": per_node, "job": per_run}.get(scope, per_run[:4] + per_node + per_run[4:]):
            # A file damaged by hand (a null where a number was) costs its own metrics, not the scrape.
            try:
                families = list(filter(None, section()))
            except (TypeError, ValueError, KeyError, AttributeError, OverflowError, RecursionError) as exc:
                self.report_once(exc)
                continue
            yield from families

    def report_once(self, exc: Exception) -> None:
        message = f"{type(exc).__name__}: {exc}"
        if message not in self.reported:
            self.reported.add(message)
            print(f"ft metrics: a section of the run's metrics left out: {message}", file=sys.stderr, flush=True)

    def goodput_metrics(self, gauge) -> list:
        accounts = self.timeline()
        return [gauge("ft_run_goodput_ratio", "Productive training time over wall time since the first start",
                      number(accounts.get("goodput")))] if accounts else []

    def restart_metrics(self) -> list:
        from prometheus_client.core import CounterMetricFamily

        starts = self.starts()
        if not starts:
            return []
        # Counted over the whole run (every job's starts): a requeued run's new series goes on from
        # the old one's count, which the restart-loop alert compares across jobs.
        restarts = CounterMetricFamily("ft_run_restarts", "Starts of the training step after the first",
                                       labels=list(self.labels))
        restarts.add_metric(list(self.labels.values()), starts - 1)
        return [restarts]

    def gpu_metrics(self) -> list:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        names = [*self.labels, "node", "gpu"]
        families = {
            "utilization": GaugeMetricFamily("ft_gpu_utilization_ratio", "GPU busy share (NVML)", labels=names),
            "memory_used": GaugeMetricFamily("ft_gpu_memory_used_bytes", "GPU memory in use", labels=names),
            "memory_total": GaugeMetricFamily("ft_gpu_memory_total_bytes", "GPU memory", labels=names),
            "temperature": GaugeMetricFamily("ft_gpu_temperature_celsius", "GPU temperature", labels=names),
            "ecc_uncorrected": CounterMetricFamily("ft_gpu_ecc_uncorrected_errors",
                                                   "Uncorrected ECC errors since the driver loaded", labels=names),
            "xid_count": CounterMetricFamily("ft_gpu_xid_errors", "Critical XID events seen by the node's launcher",
                                             labels=names),
            "last_xid": GaugeMetricFamily("ft_gpu_last_xid", "The newest critical XID's code", labels=names),
        }
        from toolkit.watch.gpus import GpuSample

        for node, message in sorted(self.messages().items()):
            wire = message.get("gpus") if isinstance(message, dict) else None
            for sample in map(GpuSample.from_wire, wire[:64] if isinstance(wire, list) else []):
                if sample is None:
                    continue
                key = [*self.labels.values(), node, str(sample.index)]
                for field, family in families.items():
                    value = getattr(sample, field)
                    if value is not None:
                        family.add_metric(key, value)
        return [family for family in families.values() if family.samples]

    def phase_metrics(self) -> list:
        """Ranks per phase (start: loading, before a first step; step; save; export; eval), from the
        launchers' heartbeats: a run whose steps stop during a long save or load is not hung."""
        from prometheus_client.core import GaugeMetricFamily

        counts = dict.fromkeys(PHASES, 0)
        for message in self.messages().values():
            ranks = message.get("ranks") if isinstance(message, dict) else None
            for place in (ranks.values() if isinstance(ranks, dict) else []):
                if isinstance(place, list) and place and place[0] in counts:
                    counts[place[0]] += 1
        if not any(counts.values()):
            return []
        family = GaugeMetricFamily("ft_run_ranks", "Ranks in each phase (start, step, save, export, eval)",
                                   labels=[*self.labels, "phase"])
        for phase, count in sorted(counts.items()):
            family.add_metric([*self.labels.values(), phase], count)
        return [family]

    def eval_metrics(self) -> list:
        """The evaluation after training (eval.json: written at the run's end, read by the last scrape
        before the exporter stops): each set's loss and task metric, per model, and the verdict."""
        from prometheus_client.core import GaugeMetricFamily

        results = read_json(self.layout.evaluation)  # a FIFO in its place never holds a scrape
        if results is None:
            return []
        names, values = [*self.labels], list(self.labels.values())
        losses = GaugeMetricFamily("ft_run_eval_loss", "Loss per labelled token (per pair: DPO) after training",
                                   labels=[*names, "model", "split"])
        scores = GaugeMetricFamily("ft_run_eval_metric", "Task metric on the golden set", labels=[*names, "model",
                                                                                                "metric"])
        for model in ("base", "adapter"):
            for split, found in (results.get(model) or {}).items():
                if isinstance(found, dict) and number(found.get("loss")) is not None:
                    losses.add_metric([*values, model, str(split)], found["loss"])
                for metric, value in ((found or {}).get("metrics") or {}).items():
                    if number(value) is not None:
                        scores.add_metric([*values, model, str(metric)], value)
        gates = GaugeMetricFamily("ft_run_eval_gate_passed", "1 when the gate passed", labels=[*names, "gate"])
        for gate in results.get("gates") or []:
            gates.add_metric([*values, str(gate["name"])], 1 if gate.get("passed") is True else 0)
        promoted = GaugeMetricFamily("ft_run_eval_promoted", "1 when the adapter passed its gates and was promoted",
                                     labels=names)
        promoted.add_metric(values, 1 if results.get("state") == "promoted" else 0)
        return [family for family in (losses, scores, gates) if family.samples] + [promoted]

    def heartbeat_metrics(self) -> list:
        from prometheus_client.core import GaugeMetricFamily

        ages = GaugeMetricFamily("ft_node_heartbeat_age_seconds", "Seconds since the node's launcher was heard",
                                 labels=[*self.labels, "node"])
        for node, age in sorted(self.heartbeats().items()):
            if number(age) is not None:
                ages.add_metric([*self.labels.values(), node], age)
        return [ages]

    def step_metrics(self, gauge) -> list:
        from prometheus_client.core import CounterMetricFamily

        progress = read_progress(self.layout.metrics)
        if progress is None:
            return []
        total = CounterMetricFamily("ft_run_tokens", "Tokens trained on", labels=list(self.labels))
        total.add_metric(list(self.labels.values()), progress.tokens)
        return [gauge("ft_run_step", "The newest optimizer step", progress.step),
                gauge("ft_run_loss", "The newest step's training loss", progress.loss),
                gauge("ft_run_learning_rate", "The newest step's learning rate", progress.learning_rate),
                gauge("ft_run_last_step_timestamp_seconds", "When the newest step ended (Unix time)", progress.time),
                gauge("ft_run_tokens_per_second", f"Tokens per second over the last {WINDOW} steps",
                      progress.tokens_per_second),
                gauge("ft_run_step_seconds", f"Seconds per step over the last {WINDOW} steps", progress.step_seconds),
                total]

    def checkpoint_metrics(self, gauge) -> list:
        try:
            status = json.loads(self.layout.checkpoint_status.read_text())
        except (OSError, ValueError, RecursionError):
            return []
        shared = status.get("shared") if isinstance(status, dict) else None
        remote = status.get("remote") if isinstance(status, dict) else None
        found = []
        for tier, place in (("shared", shared), ("remote", remote)):
            if isinstance(place, dict) and number(place.get("step")) is not None:
                found.append(gauge("ft_run_checkpoint_step", "The newest complete checkpoint's step, per tier",
                                   number(place["step"]), {"tier": tier}))
        if isinstance(shared, dict) and isinstance(remote, dict) and number(shared.get("step")) is not None:
            behind_since = number(remote.get("behind_since"))
            lag = max(time.time() - behind_since, 0.0) if behind_since is not None else 0.0
            found.append(gauge("ft_run_checkpoint_upload_lag_seconds",
                               "Seconds since the oldest shared checkpoint the mirror lacks was written", lag))
            found.append(gauge("ft_run_checkpoint_upload_failing", "1 while the mirror's uploads fail",
                               1.0 if remote.get("error") or remote.get("failing_since") else 0.0))
        return found

    def starts(self) -> int:
        """The training step's starts so far (events.jsonl: a line per start, fault and end; small)."""
        from toolkit.runs.timeline import read_lines

        return sum(e["event"] == "start" for e in read_lines(self.layout.events, {"time": (int, float), "event": str}))

    def timeline(self) -> dict | None:
        from toolkit.runs.timeline import timeline

        taken, accounts = self.goodput
        if time.monotonic() - taken > GOODPUT_EVERY_S or accounts is None:
            try:
                accounts = timeline(self.run_dir)
            except (OSError, ValueError):
                accounts = None
            self.goodput = (time.monotonic(), accounts)
        return accounts


def run_labels(run_dir: Path) -> dict[str, str]:
    """What the run serves about itself. Who it is (run, user, slurm_job) is Prometheus's target labels,
    from Slurm (toolkit/services/run_targets.py): a label served here under those names would be renamed."""
    spec = RunLayout(run_dir).read_spec()
    return {"recipe": spec.recipe.name, "method": spec.recipe.method.kind, "tier": spec.recipe.resources.tier,
            "cluster": spec.site.cluster}


class Scoped:
    """The series of one scope of a collector's: the run's own (none with a node label), or one node's.
    The collector is asked for that scope's sections alone (collect(scope)): a job of many nodes is
    scraped once per node, and each node's scrape would otherwise read every run file again."""

    def __init__(self, collector, node: str | None):
        self.collector, self.node = collector, node

    def collect(self) -> Iterator:
        from prometheus_client.metrics_core import Metric

        for family in self.collector.collect(scope="job" if self.node is None else "node"):
            kept = [sample for sample in family.samples if sample.labels.get("node") == self.node]
            if kept:
                scoped = Metric(family.name, family.documentation, family.type, family.unit)
                scoped.samples = kept
                yield scoped


def scoped_app(collector):
    """prometheus_client's WSGI app for a collector, serving the scope Prometheus asks for
    (toolkit/services/run_targets.py): ?scope=job the run's own series, ?scope=node&node=N node N's
    alone, nothing: all of them (a person's curl). Prometheus labels a node's series with Slurm's
    node name, whatever is served."""
    from urllib.parse import parse_qs

    from prometheus_client import CollectorRegistry, make_wsgi_app

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    whole = make_wsgi_app(registry)

    def app(environ, start_response):
        query = parse_qs(environ.get("QUERY_STRING", ""))
        scope, node = (query.get("scope") or [""])[0], (query.get("node") or [""])[0]
        if scope not in ("job", "node") or (scope == "node" and not node):
            return whole(environ, start_response)
        scoped = CollectorRegistry(auto_describe=False)
        scoped.register(Scoped(collector, node if scope == "node" else None))
        return make_wsgi_app(scoped)(environ, start_response)

    return app


class ScrapeCounter:
    """A WSGI app around prometheus_client's: counts the scrapes of the run's own series answered (the
    body written and closed, not merely begun), so the exporter's end can wait for one whole last
    scrape of them (a node's scrape is not counted: it carries none of the run's last state)."""

    def __init__(self, app):
        self.app = app
        self.changed = threading.Condition()
        self.answered = 0
        self.active = 0

    def __call__(self, environ, start_response):
        with self.changed:
            self.active += 1
        # Only a scrape of the run's own series counts (a node's scope carries no loss, no evaluation).
        own = "scope=node" not in environ.get("QUERY_STRING", "")
        try:
            body = self.app(environ, start_response)
        except BaseException:
            self.done(answered=False)
            raise
        return Answer(body, lambda: self.done(answered=own))

    def done(self, answered: bool = True) -> None:
        with self.changed:
            self.active -= 1
            self.answered += answered
            self.changed.notify_all()

    def wait(self, until: Callable[[], bool], timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(until, timeout)


class Answer:
    """A response body whose close() (wsgiref calls it once the body is written) is counted."""

    def __init__(self, body, on_close: Callable[[], None]):
        self.body, self.on_close = body, on_close

    def __iter__(self):
        return iter(self.body)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            getattr(self.body, "close", lambda: None)()
        self.on_close()


def serve(app, listen: str):
    """A threaded HTTP server on an ephemeral port, in a daemon thread (as prometheus_client's own)."""
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args) -> None:  # a line per scrape would bury the job's log
            pass

    server = make_server(listen, 0, app, Server, handler_class=Quiet)
    threading.Thread(target=server.serve_forever, name="ft-metrics", daemon=True).start()
    return server


class RunExporter:
    """Serves a run's metrics on an ephemeral port of the batch host and announces it to Prometheus
    through a targets file on the shared filesystem (the run spec's site.monitoring_targets, when the
    admins made that folder), removed when the exporter stops."""

    def __init__(self, run_dir: Path, heartbeats: Callable[[], dict[str, float]], host: str | None = None,
                 targets: str | None = None, listen: str = "0.0.0.0",
                 messages: Callable[[], dict[str, dict]] = dict):
        self.labels = run_labels(run_dir)
        self.collector = RunCollector(run_dir, self.labels, heartbeats, messages)
        self.scrapes = ScrapeCounter(scoped_app(self.collector))
        folder = targets if targets is not None else RunLayout(run_dir).read_spec().site.monitoring_targets
        # Named for its run and job: the cluster exporter publishes it if Slurm runs that job for the
        # file's owner (toolkit/services/run_targets.py). Outside a Slurm job nothing could vouch for it.
        job = os.environ.get("SLURM_JOB_ID", "")
        run = os.environ.get("FT_RUN_ID") or run_dir.name
        self.target_file = Path(folder) / f"{run}.{job}.json" if folder and job.isdigit() else None
        self.host = host or socket.gethostname()
        self.listen = listen  # every interface: Prometheus scrapes from another host
        self.server = None

    def start(self) -> int:
        from toolkit.base.shared_dirs import write_atomically

        self.server = serve(self.scrapes, self.listen)
        port = self.server.server_port
        if self.target_file is not None and self.target_file.parent.is_dir():
            # A claim: the address only. Its labels come from Slurm, not from this file.
            target = json.dumps([{"targets": [f"{self.host}:{port}"]}]) + "\n"
            # Prometheus (another user) reads it: world-readable, in a folder the admins made common.
            try:
                write_atomically(self.target_file, target, mode=0o644)
            except PermissionError:  # another user made a file of this name first (the folder is sticky)
                self.target_file = self.target_file.with_name(
                    f"{self.target_file.name[:-len('.json')]}-{secrets.token_hex(4)}.json")
                write_atomically(self.target_file, target, mode=0o644)
        return port

    def stop(self, final_wait_s: float | None = None) -> None:
        """Stop serving, after one more whole scrape when Prometheus has been scraping: a run's last
        state (its final loss, the fault that ended it) is what the last scrape would otherwise miss.
        The wait is at most one scrape interval, `final_wait_s` at most (FT_METRICS_FINAL_WAIT_S,
        20 s): nothing is waited for where no Prometheus watches. A scrape under way is let finish."""
        if final_wait_s is None:
            try:
                final_wait_s = min(max(float(os.environ.get("FT_METRICS_FINAL_WAIT_S", "20")), 0.0), 60.0)
            except ValueError:
                final_wait_s = 20.0
        if self.server is not None:
            answered = self.scrapes.answered
            if answered and final_wait_s > 0:
                self.scrapes.wait(lambda: self.scrapes.answered > answered, final_wait_s)
            self.scrapes.wait(lambda: self.scrapes.active == 0, min(final_wait_s, 2.0))
        if self.target_file is not None:
            self.target_file.unlink(missing_ok=True)
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
