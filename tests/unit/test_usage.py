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
from toolkit.account.usage import (
    NOT_FT,
    Accounting,
    Allocation,
    Losses,
    NodeEvent,
    Tiers,
    allocations_of,
    from_records,
    losses,
    summarise,
)
from toolkit.slurm import accounting


def parse_sacct(answer: dict, ft_only: bool = True, by_comment: bool = True) -> list[Allocation]:
    """sacct's JSON (toolkit/slurm/accounting.py) as ft counts it (toolkit/account/usage.py)."""
    return allocations_of(accounting.parse_sacct(answer), ft_only, by_comment)


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
TIERS = Tiers({"free": "free", "standard": "standard"}, {"ft-standard": "standard"}, {"free": 1.0}, 2.5)


def test_every_allocation_counts_once_with_its_own_gpus_and_time():
    allocations = parse_sacct(json.loads(sacct_json(SACCT)))
    assert [(a.run, a.state, a.gpus, a.seconds) for a in allocations] == [
        ("run-a", "REQUEUED", 2, 37), ("run-a", "REQUEUED", 2, 61), ("run-a", "COMPLETED", 2, 30),
        ("run-b", "CANCELLED", 8, 3600), ("run-c", "PENDING", 0, 0)]
    rows = {row.key: row for row in summarise(allocations, "run", TIERS, {})}
    assert rows["run-a"].allocations == 3 and rows["run-a"].gpu_hours == pytest.approx(2 * 128 / 3600)
    assert rows["run-a"].user == "alice" and rows["run-b"].gpu_hours == 8.0 and rows["run-c"].gpu_hours == 0
    everything = parse_sacct(json.loads(sacct_json(SACCT)), ft_only=False)
    by_tier = {row.key: row.to_dict() for row in summarise(everything, "tier", TIERS, {})}
    # Every job in some row: bob's hand-made job counts in the free tier, at the free tier's price.
    assert by_tier["free"]["gpu_hours"] == pytest.approx(8.0 + 600 / 3600, abs=1e-4) and by_tier["free"]["cost"] == pytest.approx(8.17, abs=0.01)
    assert by_tier["standard"]["cost"] == pytest.approx(2 * 128 / 3600 * 2.5, abs=0.01)  # the profile's price
    assert by_tier["free"]["longest_wait_s"] == 1200 and by_tier["standard"]["longest_wait_s"] == 0
    assert by_tier["standard"]["runs"] == 2 and by_tier["standard"]["allocations"] == 4
    by_run = {(row.key, row.user): row for row in summarise(everything, "run", TIERS, {})}
    assert by_run[(NOT_FT, "bob")].allocations == 1 and by_run[(NOT_FT, "bob")].runs == {""}
    # A job's tier is its partition's (its priority and preemption are the partition's), else its QOS's.
    qos = summarise(parse_sacct(json.loads(sacct_json(SACCT.replace("|standard|normal|", "|s2-standard|ft-standard|")))),
                    "tier", TIERS, {})
    assert {row.key for row in qos} == {"free", "standard"}
    cheap = parse_sacct(json.loads(sacct_json(SACCT.replace("|standard|normal|", "|standard|ft-free|"))))
    assert {row.key for row in summarise(cheap, "tier", TIERS, {})} == {"free", "standard"}  # a QOS buys no tier
    by_account = [row.key for row in summarise(allocations, "account", TIERS, {})]
    assert by_account == ["physics", "research"]  # the largest first
    priceless = Tiers({}, {}, {}, 0.0)
    assert summarise(allocations, "user", priceless, {})[0].to_dict()["cost"] is None  # no price: no cost, not 0


def test_a_job_is_a_runs_by_its_comment_where_slurm_keeps_comments_else_by_its_name():
    forged = json.loads(sacct_json(SACCT + FORGED))
    by_comment = [a for a in parse_sacct(forged) if a.run == "run-a"]
    assert {a.user for a in by_comment} == {"alice"} and len(by_comment) == 3  # bob's job is not alice's run
    assert "mine" not in {a.run for a in parse_sacct(forged)}  # nor a run of its own: not ft's
    by_name = [a for a in parse_sacct(forged, by_comment=False) if a.run == "run-a"]
    assert {a.user for a in by_name} == {"alice", "bob"}  # all a name can tell
    everything = parse_sacct(forged, ft_only=False)
    assert {a.run for a in everything} == {"", "run-a", "run-b", "run-c"} and len(everything) == 7
    # Bob's job naming alice's run in its comment is a row of its own: her run's row is hers alone.
    named = parse_sacct(json.loads(sacct_json(SACCT + FORGED.replace("|mine", "|ft-run=run-a"))))
    rows = {(row.key, row.user): row for row in summarise(named, "run", TIERS, {})}
    assert rows[("run-a", "alice")].allocations == 3 and rows[("run-a", "bob")].allocations == 1
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
                                               {("run-a", "alice"): Losses(0.02, 0.0, 0.0),
                                                ("run-c", "bob"): Losses(0.0, 0.5, 0.0)})}
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


def held(start: float, seconds: float, gpus: int = 4, nodes: tuple[str, ...] = ("n1", "n2")) -> Allocation:
    return Allocation("r", "7", "u", "a", "standard", "COMPLETED", gpus, seconds, start, nodes=nodes)


def test_a_fault_slurm_confirms_costs_what_was_redone_and_the_wait_a_preemption_costs_nothing(tmp_path):
    # Steps 1-10 every 10 s from T+20; the node is lost at T+125 (step 10 at T+110); the next start at
    # T+150 has its first step (9) at T+170, and redoes step 10 (checkpoint at 8).
    metrics = [(T + 10 + 10 * s, s) for s in range(1, 11)] + [(T + 170, 9), (T + 180, 10), (T + 190, 11)]
    faulted = run_folder(tmp_path, "faulted", [
        {"time": T, "job": "7", "event": "start"}, {"time": T + 125, "job": "7", "event": "node_lost", "node": "n2"},
        {"time": T + 150, "job": "7", "event": "start"}, {"time": T + 195, "job": "7", "event": "end", "code": 0}],
        metrics, [])
    down = [NodeEvent("n2", T + 127)]  # Slurm's own record: the node was marked down
    lost = losses(faulted, [held(T, 195)], down)
    # recovering: the last step (T+110) to the next start (T+150), 40 s; restarting: 20 s; redone: 10 s
    assert lost.refundable == pytest.approx(4 * 70 / 3600, abs=1e-4) and lost.user_error == 0
    assert lost.unconfirmed == 0
    # No node event of Slurm's (or of another node, or long before): the loss is the run's word alone.
    for events in ([], [NodeEvent("n9", T + 127)], [NodeEvent("n2", T - 3600)], None):
        unconfirmed = losses(faulted, [held(T, 195)], events)
        assert unconfirmed.refundable == 0 and unconfirmed.unconfirmed == pytest.approx(4 * 70 / 3600, abs=1e-4)
    # Requeued: the first allocation ended at T+130, the next began at T+145; the 15 s in the queue
    # between held no GPU, and cost nothing. The second allocation held 8 GPUs: its share costs 8.
    requeued = losses(faulted, [held(T, 130), held(T + 145, 50, gpus=8)], down)
    assert requeued.refundable == pytest.approx((4 * 20 + 8 * 35) / 3600, abs=1e-4)
    # A period that starts after the fault's first part (allocations clipped to it): only its share.
    clipped = losses(faulted, [held(T + 160, 35)], down)
    assert clipped.refundable == pytest.approx(4 * 20 / 3600, abs=1e-4)  # T+160..T+170 restarting, +10 redone
    preempted = run_folder(tmp_path, "preempted", [
        {"time": T, "job": "8", "event": "start"}, {"time": T + 125, "job": "8", "event": "end", "code": 8},
        {"time": T + 150, "job": "8", "event": "start"}, {"time": T + 195, "job": "8", "event": "end", "code": 0}],
        [(T + 10 + 10 * s, s) for s in range(1, 11)] + [(T + 170, 9), (T + 180, 10), (T + 190, 11)], [])
    # Steps redone after a preemption are the free tier's bargain, not a fault's cost.
    assert losses(preempted, [held(T, 130), held(T + 145, 50)], down) == Losses(0.0, 0.0, 0.0)
    nan = run_folder(tmp_path, "nan", [
        {"time": T, "job": "9", "event": "start"}, {"time": T + 360, "job": "9", "event": "end", "code": 4}],
        [(T + 10 * s, s) for s in range(1, 30)], [])
    assert losses(nan, [held(T, 400, gpus=2)], []) == Losses(0.0, 0.2, 0.0)  # a user error ended: 2 GPUs x 360 s


def test_a_forged_episode_refunds_only_what_slurms_own_records_vouch_for(tmp_path):
    """events.jsonl is the user's to write: a made-up node loss naming a node outside the allocation
    (which Slurm saw go down) refunds nothing, and one whose claimed wait runs hours past a real
    event on the allocation's node refunds the time around that event only."""
    from toolkit.account.usage import RECOVERY_MAX_S, REDONE_MAX_S

    day = 24 * 3600
    forged = run_folder(tmp_path, "forged", [
        {"time": T, "job": "7", "event": "start"},
        {"time": T + 60, "job": "7", "event": "node_lost", "node": "n9", "nodes": ["n9"]},
        {"time": T + day - 60, "job": "7", "event": "start"}, {"time": T + day, "job": "7", "event": "end", "code": 0}],
        [(T + 30, 1), (T + day - 30, 2)], [])
    elsewhere = losses(forged, [held(T, day)], [NodeEvent("n9", T + 61)])  # n9 is another job's node
    assert elsewhere.refundable == 0 and elsewhere.unconfirmed > 20  # the whole claimed wait: the run's word
    ours = losses(forged, [held(T, day)], [NodeEvent("n2", T + 61)])  # a real event on the allocation's node
    # From the last step before the fault (T+30, within REDONE_MAX_S of it) to RECOVERY_MAX_S after it.
    assert REDONE_MAX_S > 31 and ours.refundable == pytest.approx(4 * (31 + RECOVERY_MAX_S) / 3600, abs=1e-3)
    assert ours.refundable + ours.unconfirmed == pytest.approx(elsewhere.unconfirmed, abs=1e-3)


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
    from toolkit.slurm.site import AccountQuota

    assert _quota(AccountQuota(budget_gpu_hours=10, cap_gpu_hours=12), 10.5) == {
        "budget_gpu_hours": 10, "cap_gpu_hours": 12, "over_budget": True}
    assert _quota(AccountQuota(budget_gpu_hours=10), 9.9)["over_budget"] is False
    assert _quota(None, 100.0) == {}


def test_a_job_across_the_months_start_is_charged_its_part_after_it():
    from toolkit.account.usage import within

    job = held(T - 3600, 7200)  # from an hour before `since` to an hour after
    assert within(job, T).seconds == 3600 and within(job, T).start == T
    assert within(held(T + 10, 50), T).seconds == 50
    assert within(job, T - 3600, until=T).seconds == 3600  # --until: a past month alone
    assert within(held(T + 10, 50), T - 100, until=T).seconds == 0


def test_refunds_never_exceed_what_was_held(tmp_path):
    """A run's files are its user's to write: whatever they claim was lost, no more than the
    allocations held counts, and only what Slurm's node events confirm is refundable."""
    metrics = [(T + 10, 1)] + [(T + 10 + s, 1) for s in range(1, 2000)]  # step 1 'redone' 2000 times
    forged = run_folder(tmp_path, "forged", [
        {"time": T, "job": "7", "event": "start"}, {"time": T + 5, "job": "7", "event": "restart"},
        {"time": T + 6, "job": "7", "event": "start"}], metrics, [])
    small, large = held(T, 31, gpus=1), held(T + 40, 4, gpus=8)
    lost = losses(forged, [small, large], [NodeEvent("n1", T + 5)])
    assert lost.refundable + lost.unconfirmed <= (1 * 31 + 8 * 4) / 3600 + 1e-9
    assert losses(forged, [small, large], []).refundable == 0  # the run's word alone refunds nothing
