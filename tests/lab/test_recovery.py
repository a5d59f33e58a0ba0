"""Failure is normal: faults injected into real ft runs on the lab (`ft chaos`), each run ending
COMPLETED with the weights of an uninterrupted run (atol 1e-5). Inside the same Slurm job: a node
lost mid-training is replaced by the spare node the job holds; a node whose GPU fails is drained by
its own health check, its ranks checkpoint, and with no spare left the job requeues itself at once
without it; a hung rank has its stacks dumped and
training restarts from the latest checkpoint, and so does a killed rank. A lost batch host that
trains on no rank (the last spare) is succeeded inside the job: training never stops. A
free-tier run preempted by a premium job checkpoints within KillWait and resumes losing no step."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.support.prometheus import query
from tests.support.slurm import cancel, heal, sbatch, wait_for, write_script
from tests.support.tmux import Terminal
from tests.support.training import assert_same_weights, ft, lab_runs, submit, tiny_recipe, wait_done
from toolkit.lab import chaos
from toolkit.lab.manifest import state_dir

pytest.importorskip("deepspeed", reason="the training stack (ft[train]) is not installed")


@pytest.fixture(scope="module")
def runs(lab) -> Path:
    return lab_runs(lab, "recovery")


@pytest.fixture(autouse=True)
def cancel_leftovers(runs):
    """A run a failed test leaves behind would hold nodes the next tests need: cancelled."""
    yield
    for record in runs.glob("*/run.json"):
        ft("cancel", record.parent.name, runs_dir=runs)


def recipe(folder: Path, name: str, **sections) -> Path:
    document = tiny_recipe()
    for section, values in sections.items():
        document.setdefault(section, {}).update(values)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def events(run: dict) -> list[dict]:
    path = Path(run["run_dir"]) / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def finished(run: dict, runs: Path) -> None:
    try:
        state = wait_done(run["run_id"], timeout=420, runs_dir=runs)
    except AssertionError as exc:  # a run that never ends: what it did, for the one who reads CI's log
        raise AssertionError(f"{exc}\n{story(run)}") from None
    assert state == "COMPLETED", ft("logs", run["run_id"], "--rank", "0", runs_dir=runs).stdout[-3000:] + story(run)


def story(run: dict) -> str:
    """The run's timeline and the tails of its job's and nodes' logs."""
    logs = Path(run["run_dir"]) / "logs"
    parts = ["events:", *(json.dumps(e) for e in events(run))]
    for path in [logs / f"slurm-{run['job_id']}.out", *sorted(logs.glob("node-*.log"))]:
        if path.exists():
            parts += [f"--- {path.name}:", path.read_text(errors="replace")[-2000:]]
    return "\n".join(parts)


def checkpoint_after(run: dict, step: int) -> None:
    latest = Path(run["run_dir"]) / "checkpoints" / "latest"
    wait_for(f"a checkpoint after step {step}",
             lambda: latest.exists() and int(latest.read_text().strip().split("-")[1]) > step,
             timeout=300, interval=0.3)


def latest_step(run: dict) -> int:
    return int((Path(run["run_dir"]) / "checkpoints" / "latest").read_text().strip().split("-")[1])


def usage_matches_sacct(run: dict, runs: Path) -> dict:
    """`ft usage` of the run equals what sacct itself says its job used: every allocation (a requeue
    ends one and starts another), allocated GPUs x elapsed, once each. slurmdbd takes a job's end
    a moment after the job: both read again until they agree."""
    def sacct_sum() -> tuple[int, float]:
        lines = subprocess.run(["sacct", "-j", run["job_id"], "--duplicates", "-X", "--parsable2", "--noheader",
                                "--format=ElapsedRaw,AllocTRES,State"], capture_output=True, text=True).stdout
        records = [line.split("|") for line in lines.splitlines() if line]
        if any(state.startswith("RUNNING") for *_, state in records):
            return len(records), -1.0
        return len(records), sum(int(elapsed) * next((int(t.split("=")[1]) for t in tres.split(",")
                                                      if t.startswith("gres/gpu=")), 0)
                                 for elapsed, tres, _ in records) / 3600

    def agreed():
        since = time.strftime("%Y-%m-%d", time.localtime(time.time() - 86400))
        shown = ft("usage", "--by", "run", "--json", "--since", since, runs_dir=runs)
        assert shown.returncode == 0, shown.stderr
        report = json.loads(shown.stdout)
        row = next((r for r in report["rows"] if r["key"] == run["run_id"]), None)
        count, hours = sacct_sum()
        if row and hours >= 0 and row["allocations"] == count and row["gpu_hours"] == pytest.approx(hours, abs=1e-3):
            return report | {"row": row}
        return None

    report = wait_for(f"ft usage of {run['run_id']} to equal sacct's", agreed, timeout=60, interval=2)
    assert report["source"] == "Slurm accounting (sacct)"
    return report["row"]


def reasons(*nodes: str) -> dict[str, str]:
    return {node: subprocess.run(["sinfo", "--noheader", "-n", node, "-o", "%E"], capture_output=True,
                                 text=True).stdout.strip() for node in nodes}


@pytest.mark.slurm_matrix
def test_a_lost_node_is_replaced_by_a_spare_and_a_bad_gpu_with_no_spare_left_requeues(lab, tiny_baseline, runs,
                                                                                      heal_lab):
    # Slower steps: training on the spare must outlast the wait for its checkpoint and the health check.
    run = submit(recipe(runs, "spare", resources={"spare_nodes": 1},
                        env={"FT_FAULT_SLOW_STEP_S": "0.1"}), runs_dir=runs)
    checkpoint_after(run, 0)  # the first one
    first = chaos.crash_rank_node(Path(run["run_dir"]), 1).node
    wait_for("the restart on the spare", lambda: len([e for e in events(run) if e["event"] == "start"]) == 2,
             timeout=120, interval=0.3)
    checkpoint_after(run, latest_step(run))  # trained on the spare
    # Its ranks forked from the templates: the survivor's and the spare's outlived the lost node
    # (each node's template is a step of its own).
    places = [json.loads(path.read_text()) for path in sorted((Path(run["run_dir"]) / "ranks").glob("*.json"))]
    assert [(p["start"], p["warm"]) for p in places] == [("2", True), ("2", True)], places
    second = chaos.fail_gpu(Path(run["run_dir"]), 1)[0].node  # the spare's GPU: its health check drains it
    slurm_out = Path(run["run_dir"]) / "logs" / f"slurm-{run['job_id']}.out"
    wait_for("the requeue", lambda: slurm_out.exists() and any(
        "is requeued without" in line and second in line.split() for line in slurm_out.read_text().splitlines()),
        timeout=120, interval=0.5)
    out_of_service = reasons(first, second)
    wait_for("Slurm's requeue hold lifted", lambda: any(e["event"] == "requeue_hold_lifted" for e in events(run)),
             timeout=60, interval=0.5)
    heal(lab)  # the requeued job wants three nodes again: the crashed node and the GPU come back

    finished(run, runs)
    timeline = events(run)
    lost = [e for e in timeline if e["event"] == "node_lost"]
    assert [e["node"] for e in lost] == [first, second]
    assert lost[0]["marked_down"] and not lost[1]["marked_down"]  # a drain keeps the health check's reason
    assert run["run_id"] in out_of_service[first] and "no heartbeat" in out_of_service[first], out_of_service
    assert "10-gpu-devices: found 3 of" in out_of_service[second], out_of_service
    starts = [e for e in timeline if e["event"] == "start"]
    assert first in starts[0]["nodes"] and first not in starts[1]["nodes"] and second in starts[1]["nodes"]
    attempts = [json.loads(line) for line in (Path(run["run_dir"]) / "attempts.jsonl").read_text().splitlines()]
    # The spare took over inside the first job; with none left, the same job was requeued.
    assert [(a["job_id"], a["restart"]) for a in attempts[:2]] == [(run["job_id"], 0)] * 2
    assert attempts[-1]["job_id"] == run["job_id"] and attempts[-1]["restart"] >= 1
    rank0 = (Path(run["run_dir"]) / "logs" / "rank-0.log").read_text()
    stopped = rank0.split("stopping at step ", 1)[1].split(" ", 1)[0]  # the drained node's ranks checkpointed
    assert f"resumed from checkpoint step-{int(stopped):08d}" in rank0  # and no step was lost
    assert_same_weights(Path(tiny_baseline["run_dir"]), Path(run["run_dir"]), f"after losing {first}, then {second}")


def test_a_gpu_that_needs_a_restart_moves_the_run_off_and_its_node_comes_back_by_itself(tiny_baseline, runs,
                                                                                        heal_lab):
    """XID 94 (a contained ECC error: the GPU's context is lost, the GPU sound): the node's health
    check drains it for a restart, the run checkpoints and moves onto the spare, and once the run
    is off it the node's GPUs are reset and the node resumed, with no admin."""
    run = submit(recipe(runs, "xid", resources={"spare_nodes": 1},
                        env={"FT_FAULT_SLOW_STEP_S": "0.1"}), runs_dir=runs)
    checkpoint_after(run, 0)  # the first one
    node = chaos.gpu_xid(Path(run["run_dir"]), 1).node
    recorded = state_dir() / "dev" / node / "recorded"  # what the chaos wrote for the node's health check
    try:
        finished(run, runs)
        lost = [e for e in events(run) if e["event"] == "node_lost"]
        assert [e["node"] for e in lost] == [node] and not lost[0]["marked_down"]
        assert "ft-healthcheck: restart: 20-ft-health: restart: gpu_xid: XID 94" in lost[0]["reason"], lost
        wait_for(f"{node} back in service", lambda: reasons(node)[node] in ("", "none"), timeout=60, interval=1)
    finally:
        shutil.rmtree(recorded, ignore_errors=True)
    starts = [e["nodes"] for e in events(run) if e["event"] == "start"]
    assert node in starts[0] and node not in starts[-1]
    assert_same_weights(Path(tiny_baseline["run_dir"]), Path(run["run_dir"]), f"after XID 94 on {node}")


@pytest.mark.slurm_matrix
def test_a_hung_rank_then_killed_ones_are_restarted_on_the_same_nodes_and_the_loop_alert_fires(
        tiny_baseline, runs, lab):
    run = submit(recipe(runs, "hang"), runs_dir=runs)  # the watchdog's defaults
    checkpoint_after(run, 0)  # the first one
    hung = chaos.hang_rank(Path(run["run_dir"]), 1)
    checkpoint_after(run, latest_step(run))
    chaos.kill_rank(Path(run["run_dir"]), 0)
    checkpoint_after(run, latest_step(run))
    chaos.kill_rank(Path(run["run_dir"]), 1)

    finished(run, runs)
    # Three restarts in 30 minutes: the lab's Prometheus, scraping the run's watchdog, fires
    # FtRunRestartLoop (monitoring/alerts/ft-runs.rules.yml) on the counter it kept.
    firing = f'ALERTS{{alertname="FtRunRestartLoop", run="{run["run_id"]}", alertstate="firing"}}'
    assert wait_for("FtRunRestartLoop firing", lambda: query(lab.prometheus, firing), timeout=60, interval=1)
    attempts = [json.loads(line) for line in (Path(run["run_dir"]) / "attempts.jsonl").read_text().splitlines()]
    assert {a["job_id"] for a in attempts} == {run["job_id"]} and len(attempts) == 4  # one job, four starts
    node_log = (Path(run["run_dir"]) / "logs" / f"node-{hung.node}.log").read_text()
    assert "rank 1 on" in node_log and "is hung: no progress for" in node_log
    stacks = Path(run["run_dir"]) / "logs" / "stacks"
    (stopped,) = stacks.glob("rank-1.*.txt")
    assert "state T: stopped" in stopped.read_text()  # as ft chaos left it
    (waiting,) = stacks.glob("rank-0.*.txt")  # the other rank, waiting for it in a collective
    assert "worker.py" in waiting.read_text()
    timeline = events(run)
    restarts = [e["after"] for e in timeline if e["event"] == "restart"]
    assert restarts[0] == "exit 6" and len(restarts) == 3
    starts = [e["nodes"] for e in timeline if e["event"] == "start"]
    assert starts[0] == starts[1] == starts[2] == starts[3]
    assert_same_weights(Path(tiny_baseline["run_dir"]), Path(run["run_dir"]), "after a hung rank and killed ones")


def test_a_node_that_keeps_hanging_is_drained_and_the_run_goes_on_on_the_spare(tiny_baseline, runs, lab):
    """The same rank stopped twice (a node that still answers but hangs: a dead fabric port, a GPU
    stuck in the driver): the first hang restarts on the same nodes, the second (the watchdog's
    defaults: exclude_after_hangs 2) drains the node with the reason and the run finishes on the
    spare, with the weights of an uninterrupted run."""
    from toolkit.slurm import commands

    run = submit(recipe(runs, "hangs", resources={"spare_nodes": 1}, env={"FT_FAULT_SLOW_STEP_S": "0.1"}),
                 runs_dir=runs)
    checkpoint_after(run, 0)  # the first one
    first = chaos.hang_rank(Path(run["run_dir"]), 1)
    wait_for("the restart after the first hang", lambda: len([e for e in events(run) if e["event"] == "start"]) == 2,
             timeout=120, interval=0.3)
    checkpoint_after(run, latest_step(run))  # trained again on the same nodes
    second = chaos.hang_rank(Path(run["run_dir"]), 1)
    assert second.node == first.node
    try:
        finished(run, runs)
        drained = reasons(first.node)[first.node]
    finally:  # drained for an admin to look at: the admin's resume, here
        commands.run(["scontrol", "update", f"NodeName={first.node}", "State=RESUME"], check=False)
    timeline = events(run)
    (lost,) = [e for e in timeline if e["event"] == "node_lost"]
    assert lost["node"] == first.node and lost["drained_by_ft"] and not lost["marked_down"]
    assert "hung 2 times, last: rank 1 stopped" in lost["reason"]
    assert run["run_id"] in drained and "hung 2 times" in drained, drained
    blamed = [e for e in timeline if e["event"] == "rank_hung" and e["blamed"]]
    assert [(e["node"], e["rank"], e["start"]) for e in blamed] == [(first.node, 1, 1), (first.node, 1, 2)]
    starts = [e["nodes"] for e in timeline if e["event"] == "start"]
    assert starts[0] == starts[1] and first.node in starts[1] and first.node not in starts[2] and len(starts) == 3
    status = ft("status", run["run_id"], runs_dir=runs).stdout
    assert f"node {first.node} lost (hung 2 times" in status and "drained" in status, status
    assert_same_weights(Path(tiny_baseline["run_dir"]), Path(run["run_dir"]), f"after {first.node} hung twice")


def test_a_lost_node_without_a_spare_requeues_the_job_without_slurms_hold(tiny_baseline, runs, heal_lab):
    """The watchdog marks the silent node DOWN, Slurm requeues the job for it, and the helper the
    watchdog left behind lifts the hold Slurm puts on a requeued job (cred_expire)."""
    run = submit(recipe(runs, "no-spare"), runs_dir=runs)
    checkpoint_after(run, 0)  # the first one
    crashed = chaos.crash_rank_node(Path(run["run_dir"]), 1).node

    finished(run, runs)
    attempts = [json.loads(line) for line in (Path(run["run_dir"]) / "attempts.jsonl").read_text().splitlines()]
    assert {a["job_id"] for a in attempts} == {run["job_id"]} and attempts[-1]["restart"] >= 1
    assert crashed not in attempts[-1]["nodes"]
    assert [e["job"] for e in events(run) if e["event"] == "requeue_hold_lifted"] == [run["job_id"]]
    assert run["run_id"] in reasons(crashed)[crashed]
    assert_same_weights(Path(tiny_baseline["run_dir"]), Path(run["run_dir"]), f"after losing {crashed}, no spare")
    used = usage_matches_sacct(run, runs)
    assert used["allocations"] >= 2  # the job's allocation before the requeue, and after
    assert 0 < used["refundable_gpu_hours"] < used["gpu_hours"] and used["user_error_gpu_hours"] == 0


def test_a_lost_batch_host_with_a_spare_is_succeeded_inside_the_job_which_is_never_requeued(
        tiny_baseline, runs, heal_lab):
    """The batch host is the last spare: it trains on no rank. When it crashes, Slurm keeps the job
    (--no-kill) without its script; the first survivor to hear the supervisor go quiet marks the node
    DOWN and starts a successor, which adopts the training step as it runs and ends the job
    COMPLETED. One start of the job, the weights of an uninterrupted run. Training itself goes on
    (benchmarks/RECOVERY.md: 5 of 5, no step lost), except where the ranks were forked from the warm
    templates the batch host started: the lab's crash kills processes on a live network, their
    connections close, and slurmstepd ends a step whose srun client went away so (a power loss
    closes nothing); then the successor restarts training on the same nodes, as its own step."""
    # Slower steps: still training when the batch host goes, and for a while after.
    run = submit(recipe(runs, "batch-host", resources={"spare_nodes": 1},
                        env={"FT_FAULT_SLOW_STEP_S": "0.1"}), runs_dir=runs)
    checkpoint_after(run, 0)  # the first one
    crashed = chaos.crash_batch_host(Path(run["run_dir"]))

    finished(run, runs)
    attempts = [json.loads(line) for line in (Path(run["run_dir"]) / "attempts.jsonl").read_text().splitlines()]
    assert {a["restart"] for a in attempts} == {0}, attempts  # never requeued
    timeline = events(run)
    (lost,) = [e for e in timeline if e["event"] == "node_lost"]
    (took_over,) = [e for e in timeline if e["event"] == "took_over"]
    assert lost["node"] == crashed == took_over["lost"] and took_over["node"] != crashed
    places = [json.loads(path.read_text()) for path in sorted((Path(run["run_dir"]) / "ranks").glob("*.json"))]
    restarts = [e for e in timeline if e["event"] == "restart"]
    # Training went on; or, its ranks forked from the lost host's templates, it started again once.
    assert restarts == [] or (len(restarts) == 1 and len(attempts) == 2), (restarts, places)
    assert not any(e["event"] == "requeue_hold_lifted" for e in timeline)
    reason = reasons(crashed)[crashed]
    assert "batch host" in reason and run["run_id"] in reason
    batch_log = (Path(run["run_dir"]) / "logs" / f"slurm-{run['job_id']}.out").read_text()
    assert f"took over from the lost batch host {crashed}" in batch_log
    assert f"ending job {run['job_id']} with exit code 0" in batch_log
    assert_same_weights(Path(tiny_baseline["run_dir"]), Path(run["run_dir"]), f"after losing the batch host {crashed}")


def test_the_successor_carries_the_job_on_a_training_node_lost_after_the_batch_host_goes_to_the_spare(
        tiny_baseline, runs, heal_lab):
    """Two spares (the batch host the last): the batch host crashes, and the successor starts on the
    other spare; then a training node crashes, and the successor restarts training on the spare from
    the templates it took over. One start of the job throughout, the weights of an uninterrupted run."""
    run = submit(recipe(runs, "two-spares", resources={"spare_nodes": 2},
                        env={"FT_FAULT_SLOW_STEP_S": "0.1"}), runs_dir=runs)
    checkpoint_after(run, 0)
    batch_host = chaos.crash_batch_host(Path(run["run_dir"]))
    took = wait_for("the successor's take-over", lambda: next((e for e in events(run) if e["event"] == "took_over"),
                                                              None), timeout=60, interval=0.3)
    checkpoint_after(run, latest_step(run))  # training went on under the successor
    second = chaos.crash_rank_node(Path(run["run_dir"]), 1).node

    finished(run, runs)
    timeline = events(run)
    lost = [e for e in timeline if e["event"] == "node_lost"]
    assert [e["node"] for e in lost] == [batch_host, second] and lost[1]["marked_down"]  # by the successor
    restart = next(e for e in timeline if e["event"] == "restart" and e["time"] > lost[1]["time"])
    assert restart["time"] - lost[1]["time"] < 5  # the adopted step stopped at once, as one of its own would be
    # Training went on under the successor until the second loss; or, its ranks forked from the lost
    # host's templates (which the lab's crash ends: see the test above), it restarted once before.
    starts = [e for e in timeline if e["event"] == "start"]
    assert len(starts) in (2, 3) and second not in starts[-1]["nodes"] and took["node"] in starts[-1]["nodes"]
    attempts = [json.loads(line) for line in (Path(run["run_dir"]) / "attempts.jsonl").read_text().splitlines()]
    assert {(a["job_id"], a["restart"]) for a in attempts} == {(run["job_id"], 0)}  # never requeued
    # The last start's ranks forked from the templates the successor took over, or started again.
    places = [json.loads(path.read_text()) for path in sorted((Path(run["run_dir"]) / "ranks").glob("*.json"))]
    last = str(starts[-1]["start"])
    assert [(p["start"], p["warm"]) for p in places] == [(last, True), (last, True)], places
    assert_same_weights(Path(tiny_baseline["run_dir"]), Path(run["run_dir"]),
                        f"after losing the batch host {batch_host}, then {second}")


def test_a_lost_batch_host_that_trains_is_reported_by_the_survivor_and_the_job_requeued(tiny_baseline, runs,
                                                                                         heal_lab):
    """No spare: the batch host trains rank 0, and its loss breaks training. The survivor requeues
    the job at once and marks the node DOWN (Slurm would wait SlurmdTimeout), then lifts Slurm's hold."""
    run = submit(recipe(runs, "batch-host-trains"), runs_dir=runs)
    checkpoint_after(run, 0)
    crashed = chaos.crash_batch_host(Path(run["run_dir"]))

    finished(run, runs)
    attempts = [json.loads(line) for line in (Path(run["run_dir"]) / "attempts.jsonl").read_text().splitlines()]
    assert attempts[0]["restart"] == 0 and attempts[-1]["restart"] >= 1 and crashed not in attempts[-1]["nodes"]
    timeline = events(run)
    lost = [e for e in timeline if e["event"] == "node_lost"]
    assert lost[0]["node"] == crashed and lost[0]["reported_by"] != crashed  # a survivor said so, within seconds
    assert float(re.search(r"did not answer for ([0-9.]+) s", lost[0]["reason"])[1]) < 3, lost[0]
    assert not any(e["event"] == "took_over" for e in timeline)
    assert any(e["event"] == "requeue_hold_lifted" for e in timeline)  # by the survivor's helper
    reason = reasons(crashed)[crashed]
    assert "batch host" in reason and run["run_id"] in reason
    assert_same_weights(Path(tiny_baseline["run_dir"]), Path(run["run_dir"]), f"after losing the batch host {crashed}")


@pytest.mark.slurm_matrix
def test_a_preempted_free_run_checkpoints_and_resumes_where_it_stopped(lab, tiny_baseline, runs, shared_tmp):
    run = submit(recipe(runs, "free", resources={"tier": "free"}), runs_dir=runs)
    checkpoint_after(run, 0)  # the first one
    script = write_script(shared_tmp / "premium.sh", "srun sleep 5\n")
    premium = sbatch(script, f"--partition={lab.tiers['premium']}", f"--nodes={len(lab.nodes)}",
                     f"--output={shared_tmp}/p-%j")
    try:
        finished(run, runs)
    finally:
        cancel(premium)
    rank0 = (Path(run["run_dir"]) / "logs" / "rank-0.log").read_text()
    stopped = rank0.split("stopping at step ", 1)[1].split(" ", 1)[0]  # on SIGTERM, after a checkpoint
    assert f"resumed from checkpoint step-{int(stopped):08d}" in rank0  # no step lost
    attempts = [json.loads(line) for line in (Path(run["run_dir"]) / "attempts.jsonl").read_text().splitlines()]
    assert [a["restart"] for a in attempts] == [0, 1]
    assert_same_weights(Path(tiny_baseline["run_dir"]), Path(run["run_dir"]), f"after preemption at step {stopped}")
    used = usage_matches_sacct(run, runs)
    assert used["allocations"] == 2  # preempted, requeued: two allocations, each counted
    assert used["refundable_gpu_hours"] == 0  # a preemption is the free tier's bargain, not a fault


@pytest.mark.slurm_matrix
def test_a_run_near_its_time_limit_checkpoints_requeues_and_resumes(tiny_baseline, runs):
    """Slurm's USR2, checkpoint.before_time_limit (300 s) before the time limit: with a 6-minute limit it comes
    about a minute into each start (slurmctld looks every ~30 s), mid-training at these slower
    steps. The ranks checkpoint, the job script requeues the job, lifting Slurm's hold, and it
    resumes there (a start that gets the signal again goes round once more).

    Meanwhile a user follows it in a terminal (tmux) with `ft status RUN --watch`: the view is
    redrawn in place, through the requeue, and ends with the job."""
    run = submit(recipe(runs, "time-limit", resources={"time": "6"}, env={"FT_FAULT_SLOW_STEP_S": "0.3"}),
                 runs_dir=runs)
    view = Terminal([sys.executable, "-m", "toolkit", "status", run["run_id"], "--watch", "--interval", "1"],
                    runs, env={"FT_RUNS_DIR": str(runs)})
    try:
        finished(run, runs)
        assert view.exit_code(timeout=30) == 0, view.screen()
        frames, history = [*view.frames, view.screen()], view.history()
    finally:
        view.close()
    assert_watched(run["run_id"], frames, history)
    rank0 = (Path(run["run_dir"]) / "logs" / "rank-0.log").read_text()
    stops = [int(part.split(" ", 1)[0]) for part in rank0.split("stopping at step ")[1:]]  # on USR2, checkpointed
    assert stops, rank0[-2000:]
    for step in stops:
        assert f"resumed from checkpoint step-{step:08d}" in rank0  # no step lost
    attempts = [json.loads(line) for line in (Path(run["run_dir"]) / "attempts.jsonl").read_text().splitlines()]
    assert [a["restart"] for a in attempts] == list(range(len(stops) + 1))
    assert {a["job_id"] for a in attempts} == {run["job_id"]}
    batch_log = (Path(run["run_dir"]) / "logs" / f"slurm-{run['job_id']}.out").read_text()
    # Each stop was the time limit's (a signal that comes as the run ends requeues nothing).
    assert batch_log.count("time limit near: checkpointing, then requeueing") >= len(stops)
    assert [e["job"] for e in events(run) if e["event"] == "requeue_hold_lifted"] == [run["job_id"]] * len(stops)
    # The ranks stopped after their checkpoint, so the job's script was its last process (proctrack/cgroup
    # tracks them all), and left with the begin time ahead: no hold on the requeued job.
    assert batch_log.count(": leaving, its begin time") == len(stops), batch_log[-3000:]
    assert_same_weights(Path(tiny_baseline["run_dir"]), Path(run["run_dir"]), f"after the time limit at {stops}")


def assert_watched(run_id: str, frames: list[str], history: str) -> None:
    """What the live view showed: the run training (a step of the 120 with a loss, tokens/s), a
    restart after the requeue, the end, then `ft status`'s full account below it. One frame at a
    time, redrawn in place: the terminal holds the view's header once (and the account's), never
    a header per refresh scrolled off into its history."""
    header = f"run {run_id}"
    training = [f for f in frames if "RUNNING" in f and re.search(r"\b\d+/120\s+\d+\.\d{4}\s+[\d,]+", f)]
    assert training, "no frame showed the run training:\n" + "\n---\n".join(frames[-3:])
    assert any(re.search(r"\b[1-9]\d* restarts?\b", f) for f in frames), frames[-1]
    assert "COMPLETED" in frames[-1] and "120/120" in frames[-1] and "run directory" in frames[-1], frames[-1]
    assert all(f.count(header) == 1 for f in frames if header in f and "run directory" not in f)
    assert history.count(header) == 2, history[-3000:]


def test_a_full_checkpoint_disk_costs_saves_not_the_run(tiny_baseline, runs, shared_tmp):
    """The filesystem the checkpoints go to fills up (`ft chaos disk-full`, on a tmpfs made for it:
    ENOSPC from the kernel) for a while in mid-training: those saves are lost, with a warning,
    training goes on, the saves after it land, and the run ends as an uninterrupted one would."""
    staging = shared_tmp / "checkpoint-fs"
    staging.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m,mode=0700", "tmpfs", str(staging)], check=True)
    try:
        run = submit(recipe(runs, "disk-full", checkpoint={"staging": str(staging)},
                            env={"FT_FAULT_SLOW_STEP_S": "0.1"}), runs_dir=runs)
        latest = staging / "latest"
        wait_for("the first checkpoint", lambda: latest.exists(), timeout=300, interval=0.3)
        rank0_log = Path(run["run_dir"]) / "logs" / "rank-0.log"
        with chaos.checkpoint_disk_full(Path(run["run_dir"])):
            before = latest.read_text().strip()
            wait_for("a save to fail", lambda: "failed: OSError" in rank0_log.read_text()
                     or "No space left" in rank0_log.read_text(), timeout=120, interval=0.5)
            assert latest.read_text().strip() == before  # the failed save never became the latest
        finished(run, runs)
        assert latest.read_text().strip() == "step-00000120"  # the saves after it landed
        assert not (staging / chaos.BALLOON).exists()
        assert_same_weights(Path(tiny_baseline["run_dir"]), Path(run["run_dir"]), "after a full checkpoint disk")
    finally:
        subprocess.run(["umount", str(staging)], check=False)
