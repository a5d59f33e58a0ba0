"""The cluster's metrics (toolkit/watch/cluster_metrics.py) from Slurm's own output, as the lab's
Slurm 22.05 prints it, served by prometheus_client's real HTTP server."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from datetime import datetime

from toolkit.slurm.commands import CommandResult, SlurmUnavailable
from toolkit.watch.cluster_metrics import ClusterCollector, parse_jobs, parse_nodes

NOW = datetime(2026, 11, 24, 12, 0, 0).timestamp()
SINFO = """node1|idle|none
node1|idle|none
node2|drained|ft-health: gpu 2 ECC uncorrectable errors
node3|mixed|none
node4|down*|Not responding
"""
# squeue --Format=Partition:|,State:|,EligibleTime:|,Reason:| (the lab's Slurm 22.05 prints it so)
SQUEUE = """premium|PENDING|2026-11-24T11:50:00|Resources|
premium|PENDING|2026-11-24T11:58:00|Priority|
premium|PENDING|2026-11-24T09:00:00|JobHeldUser|
premium|PENDING|2026-11-24T08:00:00|Dependency|
standard|RUNNING|2026-11-24T10:00:00|None|
standard,free|PENDING|2026-11-24T11:00:00|Priority|
free|PENDING|N/A|BeginTime|
"""


def runner(sinfo: str = SINFO, squeue: str = SQUEUE, fail: bool = False):
    def run(argv, timeout=None):
        assert timeout is not None and timeout < 5  # both commands within Prometheus's scrape timeout
        if fail:
            raise SlurmUnavailable("the Slurm controller is unreachable")
        return CommandResult(tuple(argv), 0, sinfo if argv[0] == "sinfo" else squeue, "")
    return run


def samples(collector) -> dict[tuple, float]:
    found = {}
    for family in collector.collect():
        for sample in family.samples:
            found[(sample.name, *sorted(sample.labels.items()))] = sample.value
    return found


TIERS = {"free": "free", "standard": "standard", "premium": "premium"}


def test_nodes_and_queues_per_tier():
    found = samples(ClusterCollector(TIERS, runner(), now=lambda: NOW))
    assert found[("ft_node_up", ("node", "node1"))] == 1 and found[("ft_node_up", ("node", "node4"))] == 0
    assert found[("ft_node_drained", ("node", "node2"))] == 1 and found[("ft_node_drained", ("node", "node1"))] == 0
    why = "ft-health: gpu 2 ECC uncorrectable errors"
    assert found[("ft_node_drain_reason_info", ("node", "node2"), ("reason", why))] == 1
    assert not any(key[0] == "ft_node_drain_reason_info" and ("node", "node1") in key for key in found)
    assert found[("ft_node_up", ("node", "node2"))] == 0 and found[("ft_node_up", ("node", "node3"))] == 1
    premium = (("partition", "premium"), ("tier", "premium"))
    assert found[("ft_queue_pending_jobs", *premium)] == 4
    # A held job, or one waiting on another, is not the cluster failing the tier's promise.
    assert found[("ft_queue_oldest_pending_seconds", *premium)] == 600
    assert found[("ft_queue_pending_jobs", ("partition", "free"), ("tier", "free"))] == 2  # one has no time yet
    assert found[("ft_queue_oldest_pending_seconds", ("partition", "free"), ("tier", "free"))] == 3600
    assert found[("ft_queue_running_jobs", ("partition", "standard"), ("tier", "standard"))] == 1
    assert found[("ft_cluster_slurm_up",)] == 1


def test_a_silent_controller_is_said_and_no_stale_numbers_are_kept():
    found = samples(ClusterCollector(TIERS, runner(fail=True), now=lambda: NOW))
    assert found[("ft_cluster_slurm_up",)] == 0 and not any(key[0] == "ft_node_up" for key in found)
    assert found[("ft_queue_pending_jobs", ("partition", "premium"), ("tier", "premium"))] == 0


def test_parsers_take_slurms_odd_values():
    assert parse_nodes("n1|draining|maintenance\n\nbad line\n")["n1"].drained
    states = parse_nodes("n2|reserved|none\nn3|planned|none\nn4|down*|Not responding\nn5|mixed-|none\n")
    assert [states[n].up for n in ("n2", "n3", "n4", "n5")] == [True, True, False, True]
    assert parse_jobs("p|PENDING|Unknown|Priority|\n")[0].eligible is None


def test_the_exporter_serves_prometheus_text_over_http(tmp_path):
    port_file = tmp_path / "out"
    with open(port_file, "w") as output:
        process = subprocess.Popen([sys.executable, "-m", "toolkit.watch.cluster_metrics", "--port", "0",
                                    "--cluster", "lab"], stdout=output, stderr=subprocess.STDOUT,
                                   env={"PATH": "/usr/bin:/bin", "SLURM_CONF": str(tmp_path / "none.conf")})
    try:
        for _ in range(100):
            text = port_file.read_text()
            if "metrics on" in text:
                break
            time.sleep(0.1)
        port = int(text.split("metrics on ")[1].split("/")[0].rsplit(":", 1)[1])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            body = answer.read().decode()
        assert "ft_cluster_slurm_up 0.0" in body  # no Slurm here: said, not crashed
        assert 'ft_queue_pending_jobs{partition="premium",tier="premium"} 0.0' in body
    finally:
        process.terminate()
        assert process.wait(timeout=10) == 0


def test_targets_of_jobs_slurm_no_longer_runs_are_swept(tmp_path):
    """A watchdog killed with its batch host leaves its targets file: the cluster exporter removes it
    once Slurm no longer lists the job (and the file is not new); never when Slurm is silent."""
    import os

    from toolkit.watch.cluster_metrics import STALE_AFTER_S

    old = NOW - STALE_AFTER_S - 60
    files = {name: tmp_path / name for name in ("gone.41.json", "running.42.json", "young.43.json",
                                                 "not-ours.json", "array.45.json", "link.46.json")}
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    for name, path in files.items():
        if name == "link.46.json":  # planted by someone: a link to what the (root) exporter must not delete
            path.symlink_to(outside / "precious")
            os.utime(path, (old, old), follow_symlinks=False)
            continue
        path.write_text("[]")
        os.utime(path, (old, old) if name != "young.43.json" else (NOW, NOW))
    # squeue --Format JobID: an array element's own id (45), as its watchdog's SLURM_JOB_ID names its file
    squeue = "standard|RUNNING|2026-11-24T10:00:00|None|42|\nfree|RUNNING|2026-11-24T10:00:00|None|45|\n"
    silent = ClusterCollector(TIERS, runner(fail=True), now=lambda: NOW, targets=tmp_path)
    samples(silent)
    assert all(path.exists() for path in files.values())
    swept = ClusterCollector(TIERS, runner(squeue=squeue), now=lambda: NOW, targets=tmp_path)
    samples(swept)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["array.45.json", "not-ours.json", "running.42.json",
                                                                "young.43.json"]
    assert (outside / "precious").read_text() == "keep"  # the link went, not what it points to
