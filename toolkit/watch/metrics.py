"""A run's Prometheus metrics, served by its supervisor on the batch host (prometheus_client).

Nothing here runs in the training loop: each scrape reads what the run already writes (rank 0's
metrics.jsonl, the checkpoint status, the timeline) and what the supervisor already knows (the
nodes' heartbeats). A scrape costs the ranks nothing, whatever its interval.

How Prometheus finds a run (jobs come and go, on whichever batch host Slurm picks): file-based
service discovery. The supervisor writes <shared root>/monitoring/targets/<run>.json when it
starts serving and removes it when it ends; Prometheus reads every file there (file_sd_configs,
ansible/roles/prometheus). A pull keeps Prometheus's own `up` and staleness semantics (a push
gateway would keep serving a dead run's last values), and needs no agent beside the job (a textfile
collector needs node_exporter on every compute node and a shared clock for freshness).

    ft_run_info{run, recipe, method, user, cluster, slurm_job}     1
    ft_run_step, ft_run_loss, ft_run_learning_rate                 the newest step's
    ft_run_tokens_per_second, ft_run_step_seconds                  over the last WINDOW steps
    ft_run_last_step_timestamp_seconds                             when the newest step ended
    ft_run_tokens_total                                            tokens trained on
    ft_run_restarts_total                                          starts after the first
    ft_run_goodput_ratio                                           productive time / wall time
    ft_run_checkpoint_step{tier}                                   newest checkpoint per tier
    ft_run_checkpoint_upload_lag_seconds                           shared checkpoint not yet mirrored
    ft_run_checkpoint_upload_failing                               1 while uploads fail
    ft_node_heartbeat_age_seconds{node}                            since a node's launcher was heard
"""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from toolkit.runs.layout import RunLayout

WINDOW = 20  # steps the rates are taken over
TAIL_BYTES = 16384  # enough for WINDOW metrics lines
GOODPUT_EVERY_S = 60.0  # the timeline reads whole files: not at every scrape


def tail_lines(path: Path, size: int = TAIL_BYTES) -> list[dict]:
    """The last complete JSON lines of a file, read from its end (a run's file grows for days)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(handle.tell() - size, 0))
            data = handle.read()
    except OSError:
        return []
    lines = []
    for raw in data.splitlines()[1:] if len(data) >= size else data.splitlines():
        with contextlib.suppress(ValueError):
            entry = json.loads(raw)
            if isinstance(entry, dict):
                lines.append(entry)
    return lines


def number(value) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class RunCollector:
    """prometheus_client's custom-collector protocol: `collect()` yields metric families, read at
    scrape time."""

    def __init__(self, run_dir: Path, labels: dict[str, str], heartbeats: Callable[[], dict[str, float]]):
        self.run_dir, self.layout = run_dir, RunLayout(run_dir)
        self.labels = labels
        self.heartbeats = heartbeats  # node -> seconds since heard
        self.goodput: tuple[float, dict | None] = (0.0, None)
        self.scraped = threading.Event()  # set at each scrape; the exporter's end waits for one

    def collect(self) -> Iterator:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.scraped.set()
        names, values = list(self.labels), list(self.labels.values())

        def gauge(name: str, documentation: str, value: float | None, extra: dict | None = None):
            if value is None:
                return None
            family = GaugeMetricFamily(name, documentation, labels=names + list(extra or {}))
            family.add_metric(values + list((extra or {}).values()), value)
            return family

        info = GaugeMetricFamily("ft_run_info", "The run (value 1), its recipe and where it runs", labels=names)
        info.add_metric(values, 1)
        yield info
        yield from filter(None, self.step_metrics(gauge))
        yield from filter(None, self.checkpoint_metrics(gauge))
        accounts = self.timeline()
        if accounts:
            yield gauge("ft_run_goodput_ratio", "Productive training time over wall time since the first start",
                        accounts.get("goodput"))
        starts = self.starts()
        if starts:
            restarts = CounterMetricFamily("ft_run_restarts", "Starts of the training step after the first",
                                           labels=names)
            restarts.add_metric(values, starts - 1)
            yield restarts
        ages = GaugeMetricFamily("ft_node_heartbeat_age_seconds", "Seconds since the node's launcher was heard",
                                 labels=[*names, "node"])
        for node, age in sorted(self.heartbeats().items()):
            ages.add_metric([*values, node], age)
        yield ages

    def step_metrics(self, gauge) -> list:
        lines = [line for line in tail_lines(self.layout.metrics) if number(line.get("step")) is not None
                 and number(line.get("time")) is not None]
        if not lines:
            return []
        newest, window = lines[-1], lines[-WINDOW:]
        steps = newest["step"] - window[0]["step"]
        seconds = newest["time"] - window[0]["time"]
        tokens = (number(newest.get("tokens")) or 0) - (number(window[0].get("tokens")) or 0)
        rate = tokens / seconds if seconds > 0 and steps > 0 else None
        from prometheus_client.core import CounterMetricFamily

        total = CounterMetricFamily("ft_run_tokens", "Tokens trained on", labels=list(self.labels))
        total.add_metric(list(self.labels.values()), number(newest.get("tokens")) or 0)
        return [gauge("ft_run_step", "The newest optimizer step", number(newest["step"])),
                gauge("ft_run_loss", "The newest step's training loss", number(newest.get("loss"))),
                gauge("ft_run_learning_rate", "The newest step's learning rate", number(newest.get("lr"))),
                gauge("ft_run_last_step_timestamp_seconds", "When the newest step ended (Unix time)",
                      number(newest["time"])),
                gauge("ft_run_tokens_per_second", f"Tokens per second over the last {WINDOW} steps", rate),
                gauge("ft_run_step_seconds", f"Seconds per step over the last {WINDOW} steps",
                      seconds / steps if steps > 0 else None),
                total]

    def checkpoint_metrics(self, gauge) -> list:
        try:
            status = json.loads(self.layout.checkpoint_status.read_text())
        except (OSError, ValueError):
            return []
        shared = status.get("shared") if isinstance(status, dict) else None
        remote = status.get("remote") if isinstance(status, dict) else None
        found = []
        for tier, place in (("shared", shared), ("remote", remote)):
            if isinstance(place, dict) and number(place.get("step")) is not None:
                found.append(gauge("ft_run_checkpoint_step", "The newest complete checkpoint's step, per tier",
                                   number(place["step"]), {"tier": tier}))
        if isinstance(shared, dict) and isinstance(remote, dict) and number(shared.get("at")) is not None:
            behind = number(remote.get("step")) is None or remote["step"] < shared.get("step", 0)
            lag = max(time.time() - shared["at"], 0.0) if behind else 0.0
            found.append(gauge("ft_run_checkpoint_upload_lag_seconds",
                               "Seconds the newest shared checkpoint has waited for its mirror", lag))
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
    spec = RunLayout(run_dir).read_spec()
    # `slurm_job`, not `job`: Prometheus's own target label `job` (the scrape job) would rename it.
    return {"run": os.environ.get("FT_RUN_ID") or run_dir.name, "recipe": spec.recipe.name,
            "method": spec.recipe.method.kind, "user": getpass.getuser(),
            "cluster": os.environ.get("FT_CLUSTER", ""), "slurm_job": os.environ.get("SLURM_JOB_ID", "")}


class RunExporter:
    """Serves a run's metrics on an ephemeral port of the batch host and announces it to Prometheus
    through a targets file on the shared filesystem (FT_MONITORING_TARGETS, when the admins made
    that folder), removed when the exporter stops."""

    def __init__(self, run_dir: Path, heartbeats: Callable[[], dict[str, float]], host: str | None = None,
                 targets: str | None = None, listen: str = "0.0.0.0"):
        from prometheus_client import CollectorRegistry

        self.labels = run_labels(run_dir)
        self.registry = CollectorRegistry()
        self.collector = RunCollector(run_dir, self.labels, heartbeats)
        self.registry.register(self.collector)
        folder = targets if targets is not None else os.environ.get("FT_MONITORING_TARGETS", "")
        self.target_file = Path(folder) / f"{self.labels['run']}.json" if folder else None
        self.host = host or socket.gethostname()
        self.listen = listen  # every interface: Prometheus scrapes from another host
        self.server = None

    def start(self) -> int:
        from prometheus_client import start_http_server

        from toolkit.shared_dirs import write_atomically

        self.server, _ = start_http_server(0, addr=self.listen, registry=self.registry)
        port = self.server.server_port
        if self.target_file is not None and self.target_file.parent.is_dir():
            # No labels here: the metrics carry their own (a target label would rename them).
            target = [{"targets": [f"{self.host}:{port}"]}]
            # Prometheus (another user) reads it: world-readable, in a folder the admins made common.
            write_atomically(self.target_file, json.dumps(target) + "\n", mode=0o644)
        return port

    def stop(self, final_wait_s: float | None = None) -> None:
        """Stop serving, after one more scrape when Prometheus has been scraping: a run's last state
        (its final loss, the fault that ended it) is what the last scrape would otherwise miss. The
        wait is at most one scrape interval, `final_wait_s` at most (FT_METRICS_FINAL_WAIT_S, 20 s):
        nothing is waited for where no Prometheus watches."""
        if final_wait_s is None:
            try:
                final_wait_s = min(max(float(os.environ.get("FT_METRICS_FINAL_WAIT_S", "20")), 0.0), 60.0)
            except ValueError:
                final_wait_s = 20.0
        if self.server is not None and self.collector.scraped.is_set():
            self.collector.scraped.clear()
            self.collector.scraped.wait(final_wait_s)
        if self.target_file is not None:
            self.target_file.unlink(missing_ok=True)
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
