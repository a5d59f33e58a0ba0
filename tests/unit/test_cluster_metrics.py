"""The cluster's metrics (toolkit/services/cluster_metrics.py) from Slurm's own output, as the lab's
Slurm 22.05 prints it, served by prometheus_client's real HTTP server."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest

from toolkit.services.cluster_metrics import ClusterCollector
from toolkit.slurm.commands import CommandResult, SlurmUnavailable
from toolkit.slurm.jobs import parse_queue, parse_queue_lines
from toolkit.slurm.nodes import parse_node_states

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
    assert parse_node_states("n1|draining|maintenance\n\nbad line\n")["n1"].drained
    states = parse_node_states("n2|reserved|none\nn3|planned|none\nn4|down*|Not responding\nn5|mixed-|none\n")
    assert [states[n].up for n in ("n2", "n3", "n4", "n5")] == [True, True, False, True]
    assert parse_queue_lines("p|PENDING|Unknown|Priority|\n")[0].eligible is None


def test_the_exporter_serves_prometheus_text_over_http(tmp_path):
    """Started as root, as its own user once serving (here `nobody`: this venv's Python may sit where
    only root reads, and everything a scrape needs was loaded before)."""
    import os
    import pwd

    if os.geteuid() != 0:
        pytest.skip("becoming another user needs root")
    nobody = pwd.getpwnam("nobody")
    port_file = tmp_path / "out"
    with open(port_file, "w") as output:
        process = subprocess.Popen([sys.executable, "-m", "toolkit.services.cluster_metrics", "--port", "0",
                                    "--cluster", "lab", "--user", "nobody"], stdout=output, stderr=subprocess.STDOUT,
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
        uids = next(line for line in Path(f"/proc/{process.pid}/status").read_text().splitlines()
                    if line.startswith("Uid:")).split()[1:]
        assert uids == [str(nobody.pw_uid)] * 4  # real, effective, saved, filesystem: no way back to root
        assert 'ft_queue_pending_jobs{partition="premium",tier="premium"} 0.0' in body
    finally:
        process.terminate()
        assert process.wait(timeout=10) == 0


def squeue_json(*jobs: tuple) -> str:
    """`squeue --all --json` as the lab's Slurm 22.05 answers (the fields the publisher reads); a
    job's nodes are its batch host unless a sixth item names them."""
    return json.dumps({"meta": {}, "errors": [], "jobs": [
        {"job_id": job_id, "user_name": user, "batch_host": host, "comment": comment, "job_state": state,
         "nodes": nodes[0] if nodes else host}
        for job_id, user, host, comment, state, *nodes in jobs]})


def ft_script(run: str) -> str:
    """A job script of ft's for `run`, in the shape the cluster exporter checks."""
    return (f"#!/bin/bash\n# ft job script: run {run} of recipe tiny on cluster lab.\n#SBATCH --nodes=2\n"
            "set -euo pipefail\nexec /opt/ft/bin/python -m toolkit.job\n")


# A run of ft's, a job that is not ft's (no ft-run= comment), a run whose comment names something no
# run is called, one pending, and a comment that tries to forge a second job (a newline in it).
RUNNING = squeue_json((42, "alice", "node3", "ft-run=alice-llama,ft-key=k1", "RUNNING", "node[3-4]"),
                      (43, "bob", "node5", "ft-run=bob-qwen", "RUNNING"),
                      (44, "bob", "node6", "hand-written job", "RUNNING"),
                      (45, "bob", "node6", "ft-run=../../etc", "RUNNING"),
                      (46, "bob", "node6", "ft-run=bob-later", "PENDING"),
                      (47, "bob", "node6", "ft-run=x\n99999|bob|127.0.0.1|ft-run=alice-llama", "RUNNING"))


def claim(folder, name: str, owner: int, address: str = "node3:40001", body: str | None = None):
    import os

    path = folder / name
    path.write_text(body if body is not None else json.dumps([{"targets": [address]}]))
    os.chown(path, owner, owner)
    return path


def test_only_claims_slurm_vouches_for_are_published_with_slurms_labels(tmp_path, monkeypatch):
    """A claim is published when Slurm runs its job for the file's owner and the address is the
    job's batch host; its labels are Slurm's word, never the file's."""
    import os

    from toolkit.services import run_targets

    users = {"alice": 5001, "bob": 5002}
    monkeypatch.setattr(run_targets, "login_name", lambda uid: {v: k for k, v in users.items()}.get(uid))
    claims = tmp_path / "claims"
    claims.mkdir()
    claim(claims, "alice-llama.42.json", users["alice"])
    claim(claims, "bob-qwen.43.json", users["bob"], address="node3:40001")  # alice's host, not his job's
    claim(claims, "alice-llama.42-0badc0de.json", users["bob"])  # bob's file naming alice's job
    claim(claims, "ended.41.json", users["alice"])  # its job is not running: ignored, not refused
    claim(claims, "not-ft.44.json", users["bob"], address="node6:1")
    claim(claims, "other-run.42.json", users["alice"])  # a run job 42 does not run
    claim(claims, "alice-llama.42-00000001.json", users["alice"], address="node3:99999")
    claim(claims, "alice-llama.42-00000002.json", users["alice"], body="{not json")
    claim(claims, "alice-llama.42-00000003.json", users["alice"], body="[" * 4000)  # deep enough to exhaust a parser
    claim(claims, "alice-llama.42-00000004.json", users["alice"], body=" " * 5000)
    (claims / "alice-llama.42-00000005.json").symlink_to(claims / "alice-llama.42.json")
    jobs = run_targets.ft_running(parse_queue(RUNNING))
    assert set(jobs) == {"42", "43"}  # 44 is not ft's, 45 names no run, 46 waits, 47's comment is no run
    groups, refusals = run_targets.verified_targets(claims, jobs)
    who = {"run": "alice-llama", "user": "alice", "slurm_job": "42"}
    assert groups == [  # the run's own series, then each node Slurm gave the job (its node label Slurm's)
        {"targets": ["node3:40001"], "labels": who | {"scope": "job", "__param_scope": "job"}},
        *({"targets": ["node3:40001"], "labels": who | {"scope": "node", "node": node, "__param_scope": "node",
                                                       "__param_node": node}} for node in ("node3", "node4"))]
    why = {refusal.claim: refusal.why for refusal in refusals}
    assert set(why) == {"bob-qwen.43.json", "alice-llama.42-0badc0de.json", "other-run.42.json"} | {
        f"alice-llama.42-0000000{n}.json" for n in range(1, 6)}
    assert "node5" in why["bob-qwen.43.json"] and "owned by bob" in why["alice-llama.42-0badc0de.json"]
    assert "runs alice-llama" in why["other-run.42.json"]
    # Bob took the plain name first: alice's watchdog wrote <run>.<job>-<hex>.json; her newest claim counts.
    newer = claim(claims, "alice-llama.42-0000000a.json", users["alice"], address="node3:40002")
    os.utime(newer, (time.time() + 60, time.time() + 60))
    assert run_targets.verified_targets(claims, jobs)[0][0]["targets"] == ["node3:40002"]

    def unreadable(job):  # Slurm's answer about the script failing in a way nobody foresaw: not published
        raise RuntimeError("scontrol printed something new")

    groups, refusals = run_targets.verified_targets(claims, jobs, unreadable)
    assert groups == [] and any("its batch script could not be read (scontrol printed something new)" in r.why
                                for r in refusals)
    doubled = json.loads(RUNNING)
    doubled["jobs"].append(dict(doubled["jobs"][0], user_name="bob"))  # job 42 twice: no one's
    assert set(run_targets.ft_running(parse_queue(json.dumps(doubled)))) == {"43"}
    published = tmp_path / "published"
    published.mkdir()
    assert run_targets.publish(published, groups) and not run_targets.publish(published, groups)  # unchanged: kept
    assert json.loads((published / "runs.json").read_text()) == groups
    assert (published / "runs.json").stat().st_mode & 0o777 == 0o644


class Unforeseen(Exception):
    """What nobody foresaw: no narrower `except` names it."""


def test_a_claim_whose_owner_cannot_be_told_unforeseen_costs_only_itself(tmp_path, monkeypatch):
    """run_targets.py's first blind except: telling a claim's owner (the account database, through NSS)
    failing in a way nobody foresaw refuses that claim, and the others are published (narrowed to
    OSError, this test fails: checked)."""
    from toolkit.services import run_targets

    users = {"alice": 5001, "bob": 5002}

    def login_name(uid):
        if uid == users["bob"]:
            raise Unforeseen("the account database broke in a way nobody foresaw")
        return {v: k for k, v in users.items()}.get(uid)

    monkeypatch.setattr(run_targets, "login_name", login_name)
    claims = tmp_path / "claims"
    claims.mkdir()
    claim(claims, "alice-llama.42.json", users["alice"])
    claim(claims, "bob-qwen.43.json", users["bob"], address="node5:40001")
    groups, refusals = run_targets.verified_targets(claims, run_targets.ft_running(parse_queue(RUNNING)))
    assert {group["labels"]["slurm_job"] for group in groups} == {"42"}
    assert [(r.claim, r.why) for r in refusals] == [("bob-qwen.43.json",
                                                     "the account database broke in a way nobody foresaw")]


def test_a_claim_whose_reading_fails_unforeseen_costs_only_itself(tmp_path, monkeypatch):
    """run_targets.py's second blind except: reading a claim failing in a way nobody foresaw (neither
    an OSError nor a ValueError of a damaged file) refuses that claim; the job's older claim stands
    (narrowed to OSError, this test fails: checked)."""
    import os

    from toolkit.services import run_targets

    users = {"alice": 5001}
    monkeypatch.setattr(run_targets, "login_name", lambda uid: {v: k for k, v in users.items()}.get(uid))
    claims = tmp_path / "claims"
    claims.mkdir()
    claim(claims, "alice-llama.42.json", users["alice"], address="node3:40001")
    newer = claim(claims, "alice-llama.42-0000000a.json", users["alice"], address="node3:40002")
    os.utime(newer, (time.time() + 60, time.time() + 60))
    real = run_targets.read_claim

    def read_claim(path, job):
        if path.name == newer.name:
            raise Unforeseen("a claim's reading broke in a way nobody foresaw")
        return real(path, job)

    monkeypatch.setattr(run_targets, "read_claim", read_claim)
    groups, refusals = run_targets.verified_targets(claims, run_targets.ft_running(parse_queue(RUNNING)))
    assert groups and all(group["targets"] == ["node3:40001"] for group in groups)
    assert [(r.claim, r.why) for r in refusals] == [(newer.name, "a claim's reading broke in a way nobody foresaw")]


def test_the_publisher_asks_slurm_when_claims_change_and_keeps_its_word_while_slurm_is_silent(tmp_path):
    import os

    from toolkit.services.cluster_metrics import RunPublisher

    claims, published = tmp_path / "claims", tmp_path / "published"
    claims.mkdir()
    published.mkdir()
    asked = []
    answer = {"text": squeue_json((42, "root", os.uname().nodename, "ft-run=r1", "RUNNING")), "fail": False}

    def run(argv, timeout=None):
        if argv[0] == "scontrol":  # the job's batch script: ft's for run r1
            return CommandResult(tuple(argv), 0, ft_script("r1"), "")
        asked.append(argv)
        if answer["fail"]:
            raise SlurmUnavailable("the Slurm controller is unreachable")
        return CommandResult(tuple(argv), 0, answer["text"], "")

    publisher = RunPublisher(claims, published, run)
    publisher.once()
    assert json.loads((published / "runs.json").read_text()) == [] and len(asked) == 1
    publisher.once()
    assert len(asked) == 1  # nothing changed: Slurm not asked again before CACHE_S
    (claims / "r1.42.json").write_text(json.dumps([{"targets": [f"{os.uname().nodename}:9100"]}]))
    publisher.once()
    assert len(asked) == 2
    assert json.loads((published / "runs.json").read_text())[0]["labels"] == {"run": "r1", "user": "root",
                                                                              "slurm_job": "42", "scope": "job",
                                                                              "__param_scope": "job"}
    answer["fail"] = True
    (claims / "r1.42.json").unlink()
    publisher.once()  # Slurm silent: what was published stays
    assert json.loads((published / "runs.json").read_text())[0]["labels"]["run"] == "r1"
    answer["fail"] = False
    publisher.once()
    assert json.loads((published / "runs.json").read_text()) == []


def test_a_folder_flooded_with_claims_costs_a_bounded_turn_and_hides_no_ones_claim(tmp_path, monkeypatch):
    """Twenty thousand claims naming alice's job, planted by bob, and forty of alice's own: each is
    named and lstat'ed, bob's are refused unopened, alice's newest few are read, hers is published."""
    import os

    from toolkit.services import run_targets

    users = {"alice": 5001, "bob": 5002}
    monkeypatch.setattr(run_targets, "login_name", lambda uid: {v: k for k, v in users.items()}.get(uid))
    claims = tmp_path / "claims"
    claims.mkdir()
    for index in range(20_000):  # "-" sorts before ".": all of them before alice's plain name
        path = claims / f"alice-llama.42-{index:08x}.json"
        path.write_text("x")
        os.chown(path, users["bob"], users["bob"])
    for index in range(40):
        made = claim(claims, f"alice-llama.42-a{index:07x}.json", users["alice"], address=f"node3:{40000 + index}")
        os.utime(made, (1_700_000_000 + index, 1_700_000_000 + index))
    opened = []
    real = run_targets.read_claim
    monkeypatch.setattr(run_targets, "read_claim", lambda path, job: opened.append(path.name) or real(path, job))
    jobs = run_targets.ft_running(parse_queue(RUNNING))
    groups, refusals = run_targets.verified_targets(claims, jobs)
    assert groups[0]["targets"] == ["node3:40039"] and groups[0]["labels"]["user"] == "alice"
    assert len(opened) == run_targets.MAX_CLAIMS_READ and all(name.startswith("alice-llama.42-a") for name in opened)
    assert len(refusals) == run_targets.MAX_REFUSALS + 1 and refusals[-1].why == "refused"


@pytest.mark.parametrize("script, why", [
    ("#!/bin/bash\nsleep 600\n", "is not ft's job script of run r1"),  # the review's plain job
    (ft_script("another-run"), "is not ft's job script of run r1"),  # ft's, of a run the comment does not name
    (ft_script("r1") + "sleep 600\n", "does not end by handing over to ft's job controller"),
])
def test_a_job_whose_batch_script_is_not_fts_is_not_published(tmp_path, script, why):
    """Slurm's copy of the batch script decides, asked once a job: a job with ft's comment and claim but
    another script is refused, named in the exporter's log."""
    import os

    from toolkit.services.cluster_metrics import RunPublisher

    claims, published = tmp_path / "claims", tmp_path / "published"
    claims.mkdir()
    published.mkdir()
    scripts_asked = []

    def run(argv, timeout=None):
        if argv[0] == "scontrol":
            scripts_asked.append(argv[3])
            return CommandResult(tuple(argv), 0, script, "")
        return CommandResult(tuple(argv), 0, squeue_json((42, "root", os.uname().nodename, "ft-run=r1", "RUNNING")), "")

    (claims / "r1.42.json").write_text(json.dumps([{"targets": [f"{os.uname().nodename}:9100"]}]))
    publisher = RunPublisher(claims, published, run)
    publisher.once()
    assert json.loads((published / "runs.json").read_text()) == []
    assert why in publisher.refused["r1.42.json"]
    (claims / "r1.42.json").touch()
    os.utime(claims, (0, 0))  # the folder changed: another turn
    publisher.once()
    assert scripts_asked == ["42"]  # a job's script never changes: asked once


def test_the_run_exporter_serves_each_scope_apart(tmp_path):
    """?scope=job: the run's own series, none naming a node; ?scope=node&node=N: node N's alone."""
    from prometheus_client.core import GaugeMetricFamily

    from toolkit.watch.metrics import scoped_app

    class Served:
        def collect(self, scope=None):  # every section, whatever the scope: the filter still holds
            loss = GaugeMetricFamily("ft_run_loss", "loss")
            loss.add_metric([], 1.5)
            temperature = GaugeMetricFamily("ft_gpu_temperature_celsius", "t", labels=["node", "gpu"])
            for node in ("node1", "node2", "node9"):
                temperature.add_metric([node, "0"], 60.0)
            yield from (loss, temperature)

    app = scoped_app(Served())

    def scrape(query: str) -> str:
        answered = []
        body = app({"REQUEST_METHOD": "GET", "PATH_INFO": "/metrics", "QUERY_STRING": query},
                   lambda status, headers: answered.append(status))
        assert answered[0].startswith("200")
        return b"".join(body).decode()

    job = scrape("scope=job")
    assert "ft_run_loss 1.5" in job and "ft_gpu_temperature_celsius" not in job
    node = scrape("scope=node&node=node2")
    assert 'node="node2"' in node and "node1" not in node and "node9" not in node and "ft_run_loss" not in node
    everything = scrape("")
    assert "ft_run_loss" in everything and 'node="node9"' in everything


def test_a_bad_turn_never_ends_the_publishing(tmp_path, monkeypatch, capsys):
    """services/cluster_metrics.py's blind except: a turn that raises anything (here a RuntimeError
    from deep in a claim's reading) is printed, and the next turn comes."""
    import threading

    from toolkit.services import cluster_metrics

    monkeypatch.setattr(cluster_metrics, "PUBLISH_EVERY_S", 0.0)
    stopped, turns = threading.Event(), []

    def once() -> None:
        turns.append(1)
        if len(turns) == 1:
            raise RuntimeError("a claim's reading broke in a way nobody foresaw")
        stopped.set()

    publisher = cluster_metrics.RunPublisher(tmp_path / "claims", tmp_path / "published")
    monkeypatch.setattr(publisher, "once", once)
    publisher.forever(stopped)
    assert len(turns) == 2
    assert "publishing the runs' targets failed: RuntimeError" in capsys.readouterr().out
