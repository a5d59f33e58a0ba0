"""toolkit/slurm reads every Slurm release the lab runs the same way: recorded answers of each
(tests/unit/recorded/slurm/<release>/, made on the lab by scripts/record-slurm-outputs.sh: a job of
ft's shape running on 2 nodes with 2 GPUs each and the comment ft-run=recorded, then requeued and
cancelled; a second job waiting on it) give the same typed results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from toolkit.services import run_targets
from toolkit.slurm import accounting, commands, jobs, nodes, shapes
from toolkit.slurm.client import CliSlurmClient
from toolkit.slurm.commands import CommandResult

RECORDED = Path(__file__).parent / "recorded" / "slurm"
RELEASES = sorted(path.name for path in RECORDED.iterdir() if (path / "VERSION").is_file())


def test_every_release_the_lab_runs_is_recorded():
    from toolkit.lab.manifest import BUILT_SLURMS, PACKAGE_SLURM

    assert set(RELEASES) >= {PACKAGE_SLURM}
    assert set(RELEASES) <= {PACKAGE_SLURM, *BUILT_SLURMS}


def recorded(release: str, name: str) -> str:
    return (RECORDED / release / name).read_text()


def answering(release: str, outputs: dict[str, str]):
    """A command runner (commands.run's signature) that answers a command line starting with a key
    with that key's recorded file."""
    def run(argv, timeout=None, check=True):
        for prefix, name in outputs.items():
            if " ".join(argv).startswith(prefix):
                return CommandResult(tuple(argv), 0, recorded(release, name), "")
        raise AssertionError(f"not recorded: {argv}")
    return run


@pytest.fixture(params=RELEASES)
def release(request) -> str:
    return request.param


def test_the_queue_reads_alike_on_every_release(release):
    listed = jobs.parse_queue(recorded(release, "squeue-all.json"))
    job = next(job for job in listed if job.comment == "ft-run=recorded")
    assert job.state == "RUNNING" and job.user == "root" and job.account
    assert job.gpus == 4 and job.nodes == "node[1-2]" and job.batch_host == "node1"
    assert job.time_limit_min == 10 and job.end_time and job.eligible_time
    waiting = next(job for job in listed if job.comment == "ft-run=waiting")
    assert waiting.state == "PENDING" and waiting.reason == "Dependency" and waiting.end_time is None
    version = shapes.version(json.loads(recorded(release, "squeue-all.json")))
    assert version == tuple(int(part) for part in recorded(release, "VERSION").split("."))


def test_a_running_ft_job_is_scraped_and_signed_on_every_release(release):
    """What the run targets and the signer trust: Slurm's running jobs of ft's (the defect of 23.11
    on: job_state became a list, and no run was ever published or signed)."""
    running = run_targets.running_ft_jobs(answering(release, {"squeue": "squeue-all.json"}))
    queued = next(job for job in jobs.parse_queue(recorded(release, "squeue-all.json"))
                  if job.comment == "ft-run=recorded")
    (found,) = running.values()
    assert found == run_targets.RunningJob(queued.job_id, "root", "node1", "recorded", found.nodes)
    assert found.nodes and found.nodes[0] == "node1"  # Slurm's nodes, expanded: each is a target of its own


def test_a_requeued_job_waits_with_its_reason(release):
    (job, *_) = [job for job in jobs.parse_queue(recorded(release, "squeue-requeued.json"))
                 if job.comment == "ft-run=recorded"]
    assert job.state == "PENDING" and job.reason in {"BeginTime", "None", "Priority", "Resources"}


def test_accounting_keeps_each_allocation_on_every_release(release):
    allocations = [job for job in accounting.parse_sacct(json.loads(recorded(release, "sacct-jobs.json")))
                   if job.comment == "ft-run=recorded"]
    states = [job.state for job in allocations]
    assert states[0] == "REQUEUED" and states[-1] == "CANCELLED" and len(allocations) == 2
    first = allocations[0]
    assert first.gpus == 4 and first.nodes == ("node1", "node2") and first.user == "root"
    assert first.elapsed_s is not None and first.start and first.eligible and first.name == "ft-recorded"
    waiting = next(job for job in accounting.parse_sacct(json.loads(recorded(release, "sacct-jobs.json")))
                   if job.comment == "ft-run=waiting")
    assert waiting.start is None and waiting.gpus == 0  # it never ran: it held nothing


def test_nodes_and_partitions_read_alike_on_every_release(release):
    details = nodes.parse_node_details(json.loads(recorded(release, "sinfo-nodes.json")))
    assert details and all(node.name.startswith("node") for node in details)
    assert all(node.state in {"idle", "mixed", "allocated", "completing"} for node in details)
    assert all(flag == flag.upper() and flag != node.state.upper() for node in details for flag in node.flags)
    assert all("gpu" in node.gres for node in details)
    states = nodes.parse_node_states(recorded(release, "sinfo-node-states.txt"))
    assert set(states) == {node.name for node in details} and all(state.up for state in states.values())
    gres = nodes.parse_node_gres(recorded(release, "sinfo-node-gres.txt"))
    assert {(node.gpus, node.cpus, node.memory_mb) for node in gres.values()} == {(4, 4, 4096)}
    assert "standard" in gres["node1"].partitions
    partitions = nodes.parse_partitions(recorded(release, "scontrol-show-partition.txt"))
    assert partitions["standard"].default and set(recorded(release, "sinfo-partitions.txt").split()) == set(partitions)
    asked = nodes.node_details(answering(release, {"sinfo --Node --json": "sinfo-nodes.json"}))
    assert asked == details
    config = nodes.config(answering(release, {"scontrol show config": "scontrol-show-config.txt"}))
    assert config["ClusterName"] == "lab" and "job_comment" in config["AccountingStoreFlags"]


def test_the_schedulers_start_plan_reads_alike_on_every_release(release, tmp_path):
    plan = jobs.test_only(tmp_path / "job.sh", answering(release, {"sbatch": "sbatch-test-only.txt"}))
    assert plan.start is not None and plan.nodes == "node[1-2]"


def test_one_jobs_brief_and_the_own_queue_read_alike_on_every_release(release, monkeypatch):
    from toolkit.slurm import commands

    listed = jobs.parse_queue(recorded(release, "squeue-all.json"))
    job_id = next(job.job_id for job in listed if job.comment == "ft-run=recorded")
    monkeypatch.setattr(commands, "run", answering(release, {"scontrol show job": "scontrol-show-job.txt",
                                                             "squeue": "squeue-own.txt"}))
    brief = CliSlurmClient().job_brief(job_id)
    assert brief is not None and brief.state == "RUNNING" and brief.restarts == 0 and brief.nodes == "node[1-2]"
    assert set(CliSlurmClient().queued_runs()) == {"recorded", "waiting"}
    assert jobs.batch_host(job_id, answering(release, {"squeue": "squeue-batch-host.txt"})) == "node1"


def test_accounts_and_caps_read_alike_on_every_release(release):
    assert "ft-standard" in accounting.qos_names(answering(release, {"sacctmgr": "sacctmgr-qos.txt"}))
    associations = accounting.user_associations("root", answering(release,
                                                                  {"sacctmgr": "sacctmgr-associations.txt"}))
    assert {"research", "capped"} <= set(associations)
    used = accounting.parse_assoc_gpu_minutes(recorded(release, "scontrol-assoc-mgr.txt"), "capped")
    assert used is not None and all(minutes >= 0 for minutes in used)


@pytest.mark.parametrize(("value", "expected"), [
    (1700000000, 1700000000),  # 22.05
    ({"set": True, "infinite": False, "number": 1700000000}, 1700000000),  # 23.02 on
    ({"set": False, "infinite": False, "number": 0}, None),  # unset
    ({"set": True, "infinite": True, "number": 0}, None),  # UNLIMITED
    (4294967294, None),  # 24.11: NO_VAL as a plain number (a start that never came)
    (65534, 65534),  # not a marker: a job id, a number of seconds
    (float("inf"), None), (float("nan"), None), (1e300, 1e300),
    (True, None), ("12", None), (None, None),
])
def test_numbers_of_every_version_read_alike(value, expected):
    assert shapes.number(value) == expected


@pytest.mark.parametrize(("value", "state", "flags"), [
    ("RUNNING", "RUNNING", ()),  # 22.05: one word, a flag's where the job has one
    ("COMPLETING", "COMPLETING", ()),
    (["RUNNING"], "RUNNING", ()),  # 23.02 on: the base state, then its flags; read as 22.05 words it
    (["PENDING", "REQUEUED"], "REQUEUED", ("REQUEUED",)),  # sacct 24.11: an allocation a requeue ended
    (["COMPLETED", "COMPLETING"], "COMPLETING", ("COMPLETING",)),  # not finished yet, on either release
    (["RUNNING", "CONFIGURING"], "CONFIGURING", ("CONFIGURING",)),
    (["PENDING", "REQUEUE_HOLD", "REQUEUED"], "REQUEUED", ("REQUEUE_HOLD", "REQUEUED")),
    ({"current": ["COMPLETED"], "reason": "None"}, "COMPLETED", ()),  # sacct 24.11
    ({"current": "CANCELLED by 0", "reason": "None"}, "CANCELLED", ()),  # sacct 22.05
    ([], "", ()), (None, "", ()),
])
def test_job_states_of_every_version_read_alike(value, state, flags):
    assert (shapes.state(value), shapes.state_flags(value)) == (state, flags)


def test_a_json_reader_that_forgot_json_still_asks_for_it(release):
    # Without --json, sinfo prints its table and the reader would see no JSON at all.
    runner = answering(release, {"sinfo --Node --json": "sinfo-nodes.json"})
    answer = commands.run_json(["sinfo", "--Node"], runner=runner)
    assert nodes.parse_node_details(answer)



def test_the_durations_a_requeue_waits_on_read_alike_on_every_release(release, monkeypatch):
    """KillWait and MessageTimeout, as the requeue's hold lifting reads them (toolkit/watch/requeue.py)."""
    monkeypatch.setattr(commands, "run", answering(release, {"scontrol show config": "scontrol-show-config.txt"}))
    slurm = CliSlurmClient()
    assert (slurm.config_seconds("KillWait"), slurm.config_seconds("MessageTimeout")) == (5, 10)
