"""`ft usage` (toolkit/account/usage.py): GPU-hours from sacct's records as the lab's Slurm 22.05 prints
them, every allocation once; the run records where accounting is off; what faults cost."""

# ruff: noqa: E501 - sacct's lines below are kept as Slurm prints them

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.run_specs import run_spec, write_run_spec
from tests.support.sacct import sacct_json
from toolkit.account.usage import Accounting, Allocation, Losses, from_records, losses, parse_sacct, summarise

# sacct --allusers --duplicates -X --json: job 48 requeued twice (a node lost, then preempted) then
# completed; 49 a run of another account on the free tier; a job that is not ft's; one still pending.
# Run b waited 20 minutes for its nodes. The last column, each job's comment, is how ft knows its jobs.
SACCT = """48|ft-run-a|alice|research|standard|normal|REQUEUED|37|billing=2,cpu=2,gres/gpu=2,mem=8G,node=2|2026-11-24T20:18:03|2026-11-24T20:18:40|2026-11-24T20:18:03|ft-run=run-a
48|ft-run-a|alice|research|standard|normal|REQUEUED|61|billing=2,cpu=2,gres/gpu=2,mem=8G,node=2|2026-11-24T20:18:41|2026-11-24T20:19:42|2026-11-24T20:18:41|ft-run=run-a
48|ft-run-a|alice|research|standard|normal|COMPLETED|30|billing=2,cpu=2,gres/gpu=2,mem=8G,node=2|2026-11-24T20:19:43|2026-11-24T20:20:13|2026-11-24T20:19:43|ft-run=run-a,ft-key=k1
49|ft-run-b|bob|physics|free|normal|CANCELLED by 0|3600|billing=8,cpu=8,gres/gpu=8,mem=32G,node=1|2026-11-24T20:29:52|2026-11-24T21:29:52|2026-11-24T20:09:52|ft-run=run-b
50|hand-made|bob|physics|free|normal|COMPLETED|600|billing=1,cpu=1,gres/gpu=1,node=1|2026-11-24T20:29:52|2026-11-24T20:39:52|2026-11-24T20:29:52
51|ft-run-c|bob|physics|standard|normal|PENDING|0||Unknown|Unknown|Unknown|ft-run=run-c
"""
# Bob names a job of his as alice's run; its comment is his own.
FORGED = "52|ft-run-a|bob|physics|standard|normal|COMPLETED|600|gres/gpu=4|2026-11-24T21:00:00|2026-11-24T21:10:00|2026-11-24T21:00:00|mine"
TIERS = {"free": "free", "standard": "standard"}


def test_every_allocation_counts_once_with_its_own_gpus_and_time():
    allocations = parse_sacct(json.loads(sacct_json(SACCT)))
    assert [(a.run, a.state, a.gpus, a.seconds) for a in allocations] == [
        ("run-a", "REQUEUED", 2, 37), ("run-a", "REQUEUED", 2, 61), ("run-a", "COMPLETED", 2, 30),
        ("run-b", "CANCELLED", 8, 3600), ("run-c", "PENDING", 0, 0)]
    rows = {row.key: row for row in summarise(allocations, "run", TIERS, {})}
    assert rows["run-a"].allocations == 3 and rows["run-a"].gpu_hours == pytest.approx(2 * 128 / 3600)
    assert rows["run-b"].gpu_hours == 8.0 and rows["run-c"].gpu_hours == 0
    by_tier = {row.key: row.to_dict(price=2.5) for row in summarise(allocations, "tier", TIERS, {})}
    assert by_tier["free"]["gpu_hours"] == 8.0 and by_tier["free"]["cost"] == 20.0
    assert by_tier["free"]["longest_wait_s"] == 1200 and by_tier["standard"]["longest_wait_s"] == 0
    assert by_tier["standard"]["runs"] == 2 and by_tier["standard"]["allocations"] == 4
    # Jobs of another set of partitions (the lab's second slice), known by their tier's QOS.
    qos = summarise(parse_sacct(json.loads(sacct_json(SACCT.replace("|standard|normal|", "|s2-standard|ft-standard|")))),
                    "tier", TIERS, {},
                    {"ft-standard": "standard"})
    assert {row.key for row in qos} == {"free", "standard"}
    by_account = [row.key for row in summarise(allocations, "account", TIERS, {})]
    assert by_account == ["physics", "research"]  # the largest first


def test_a_job_is_a_runs_by_its_comment_where_slurm_keeps_comments_else_by_its_name():
    forged = json.loads(sacct_json(SACCT + FORGED))
    by_comment = [a for a in parse_sacct(forged) if a.run == "run-a"]
    assert {a.user for a in by_comment} == {"alice"} and len(by_comment) == 3  # bob's job is not alice's run
    assert "mine" not in {a.run for a in parse_sacct(forged)}  # nor a run of its own: not ft's
    by_name = [a for a in parse_sacct(forged, by_comment=False) if a.run == "run-a"]
    assert {a.user for a in by_name} == {"alice", "bob"}  # all a name can tell
    everything = parse_sacct(forged, ft_only=False)
    assert {a.run for a in everything} >= {"hand-made", "run-a"} and len(everything) == 7
    # Slurm 23.02+ wraps numbers ({"set", "number"}) and lists a state: read the same.
    newer = json.loads(sacct_json(SACCT))
    for job in newer["jobs"]:
        job["time"] = {key: {"set": True, "number": value} for key, value in job["time"].items()}
        job["state"] = {"current": [job["state"]["current"]]}
    assert parse_sacct(newer) == parse_sacct(json.loads(sacct_json(SACCT)))


def test_what_slurm_keeps_is_said_beside_the_figures(monkeypatch):
    kept = Accounting.of({"AccountingStoreFlags": "job_comment", "PrivateData": "none"})
    assert kept.keeps_comments and not kept.private_jobs and kept.notes() == ["ft's jobs by their comment"]
    private = Accounting.of({"AccountingStoreFlags": "(null)", "PrivateData": "accounts,jobs"})
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    notes = private.notes()
    assert not private.keeps_comments and "AccountingStoreFlags=job_comment" in notes[0]
    assert "PrivateData" in notes[1] and "only your own" in notes[1]


def test_losses_count_once_per_run_and_unknown_stays_unknown():
    allocations = parse_sacct(json.loads(sacct_json(SACCT)))
    rows = {row.key: row for row in summarise(allocations, "user", TIERS,
                                               {"run-a": Losses(0.02, 0.0), "run-c": Losses(0.0, 0.5)})}
    assert rows["alice"].refundable_gpu_hours == 0.02  # three allocations, one run: counted once
    assert rows["bob"].refundable_gpu_hours is None  # run-b's records are not readable here: not a zero


def run_folder(tmp_path: Path, name: str, events: list[dict], metrics: list[tuple[float, int]],
               attempts: list[dict]) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    spec = run_spec()
    data = spec.recipe.model_dump(mode="json")
    recipe = spec.recipe.model_validate(data | {"resources": data["resources"] | {"gpus_per_node": 4}})
    write_run_spec(folder, spec.model_copy(update={"recipe": recipe}))
    (folder / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"time": t, "step": s}) + "\n" for t, s in metrics))
    (folder / "attempts.jsonl").write_text("".join(json.dumps(a) + "\n" for a in attempts))
    return folder


T = 1_795_000_000.0


def held(start: float, seconds: float, gpus: int = 4) -> Allocation:
    return Allocation("r", "7", "u", "a", "standard", "COMPLETED", gpus, seconds, start)


def test_a_fault_costs_what_was_redone_and_the_wait_a_preemption_costs_nothing_refundable(tmp_path):
    # Steps 1-10 every 10 s from T+20; the node is lost at T+125 (step 10 at T+120); the next start at
    # T+150 has its first step at T+170, redoing steps 9 and 10 (checkpoint at 8).
    metrics = [(T + 10 + 10 * s, s) for s in range(1, 11)] + [(T + 170, 9), (T + 180, 10), (T + 190, 11)]
    faulted = run_folder(tmp_path, "faulted", [
        {"time": T, "job": "7", "event": "start"}, {"time": T + 125, "job": "7", "event": "node_lost", "node": "n2"},
        {"time": T + 150, "job": "7", "event": "start"}, {"time": T + 195, "job": "7", "event": "end", "code": 0}],
        metrics, [])
    lost = losses(faulted, [held(T, 195)])
    # recovering: the last step (T+120) to the next start (T+150), 30 s; restarting: 20 s; redone: 20 s
    assert lost.refundable == pytest.approx(4 * 70 / 3600, abs=1e-4) and lost.user_error == 0
    # Requeued: the first allocation ended at T+130, the next began at T+145; the 15 s in the queue
    # between held no GPU, and cost nothing.
    requeued = losses(faulted, [held(T, 130), held(T + 145, 50)])
    assert requeued.refundable == pytest.approx(4 * 55 / 3600, abs=1e-4)
    preempted = run_folder(tmp_path, "preempted", [
        {"time": T, "job": "8", "event": "start"}, {"time": T + 125, "job": "8", "event": "end", "code": 8},
        {"time": T + 150, "job": "8", "event": "start"}, {"time": T + 195, "job": "8", "event": "end", "code": 0}],
        [(T + 10 + 10 * s, s) for s in range(1, 11)] + [(T + 170, 11), (T + 180, 12)], [])
    assert losses(preempted, [held(T, 130), held(T + 145, 50)]) == Losses(0.0, 0.0)
    nan = run_folder(tmp_path, "nan", [
        {"time": T, "job": "9", "event": "start"}, {"time": T + 360, "job": "9", "event": "end", "code": 4}],
        [(T + 10 * s, s) for s in range(1, 30)], [])
    assert losses(nan, [held(T, 400, gpus=2)]) == Losses(0.0, 0.2)  # what a user error ended: 2 GPUs x 360 s


def test_without_accounting_the_run_records_give_each_allocation(tmp_path):
    folder = run_folder(tmp_path, "rec", [
        {"time": T + 10, "job": "7", "event": "start"}, {"time": T + 1800, "job": "7", "event": "end", "code": 0}],
        [], [{"job_id": "7", "restart": 0, "started": T}, {"job_id": "7", "restart": 1, "started": T + 600},
             {"job_id": "7", "restart": 0, "started": T + 1200}])
    allocations = from_records([("rec", folder)], lambda _: 8, now=T + 5000, since=0)
    assert [(a.job_id, a.seconds) for a in allocations] == [("7", 1200), ("7", 600)]  # a restart is no new one
    limited = from_records([("rec", folder)], lambda _: 8, now=T + 5000, since=0, limit_of=lambda _: 900)
    assert [a.seconds for a in limited] == [900, 600]  # never past the job's time limit


def test_ft_usage_says_it_used_the_run_records_where_slurm_does_not_answer(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    folder = run_folder(runs, "rec", [
        {"time": time.time() - 3600, "job": "7", "event": "start"}, {"time": time.time(), "job": "7",
                                                                      "event": "end", "code": 0}],
        [], [{"job_id": "7", "restart": 0, "started": time.time() - 3600}])
    (folder / "run.json").write_text(json.dumps({
        "run_id": "rec", "recipe_name": "unit", "recipe_path": "/r.yaml", "cluster": "lab", "mode": "train",
        "created": time.time(), "idempotency_key": None, "jobs": [{"job_id": "7", "submitted": time.time()}]}))
    env = {**os.environ, "FT_RUNS_DIR": str(runs), "SLURM_CONF": str(tmp_path / "none.conf"),
           "PATH": "/usr/bin:/bin"}
    shown = subprocess.run([sys.executable, "-m", "toolkit", "usage", "--json", "--since", "2000-01-01"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    assert report["source"].startswith("ft's run records")
    (row,) = report["rows"]
    assert row["key"] == "rec" and row["gpu_hours"] == pytest.approx(4 * 1.0, abs=0.01)  # 1 node x 4 GPUs, 1 h
    bad = subprocess.run([sys.executable, "-m", "toolkit", "usage", "--since", "last tuesday"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode != 0 and "YYYY-MM-DD" in bad.stderr


def test_an_account_over_its_budget_is_flagged():
    from toolkit.cli.usage import _quota
    from toolkit.cluster.profile import AccountQuota

    assert _quota(AccountQuota(budget_gpu_hours=10, cap_gpu_hours=12), 10.5) == {
        "budget_gpu_hours": 10, "cap_gpu_hours": 12, "over_budget": True}
    assert _quota(AccountQuota(budget_gpu_hours=10), 9.9)["over_budget"] is False
    assert _quota(None, 100.0) == {}


def test_a_job_across_the_months_start_is_charged_its_part_after_it():
    from toolkit.account.usage import within

    job = held(T - 3600, 7200)  # from an hour before `since` to an hour after
    assert within(job, T).seconds == 3600 and within(job, T).start == T
    assert within(held(T + 10, 50), T).seconds == 50


def test_refunds_never_exceed_what_was_held(tmp_path):
    """A run's files are its user's to write: whatever they claim was redone, no more than the
    allocations held is refundable."""
    metrics = [(T + 10, 1)] + [(T + 10 + s, 1) for s in range(1, 2000)]  # step 1 'redone' 2000 times
    forged = run_folder(tmp_path, "forged", [{"time": T, "job": "7", "event": "start"}], metrics, [])
    lost = losses(forged, [held(T, 100)])
    assert lost.refundable <= 4 * 100 / 3600 + 1e-9


def test_a_run_folder_counts_only_for_the_jobs_it_records_and_its_owner_ran(tmp_path):
    import pwd

    from toolkit.cli.usage import _runs_these_jobs

    folder = run_folder(tmp_path, "mine", [], [], [])
    (folder / "run.json").write_text(json.dumps({"jobs": [{"job_id": "7"}]}))
    me = pwd.getpwuid(os.getuid()).pw_name
    assert _runs_these_jobs(folder, [Allocation("mine", "7", me, "a", "p", "COMPLETED", 4, 60, T)])
    assert not _runs_these_jobs(folder, [Allocation("mine", "8", me, "a", "p", "COMPLETED", 4, 60, T)])
    assert not _runs_these_jobs(folder, [Allocation("mine", "7", "someone-else", "a", "p", "COMPLETED", 4, 60, T)])
