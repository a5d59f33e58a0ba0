"""`ft submit` on the lab: a 2-node job through to completion, the exact script kept, idempotent
submission, hostile strings carried without executing, refusals that leave nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.support.slurm import job_fields, wait_for
from tests.support.training import tiny_recipe
from toolkit.runs.layout import RunLayout
from toolkit.runs.store import RunStore
from toolkit.slurm import commands
from toolkit.slurm.client import CliSlurmClient

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny-lora-sft.yaml"


def ft(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True,
                          timeout=120, **kwargs)


@pytest.fixture
def runs_dir(shared_tmp, monkeypatch) -> Path:
    """Runs of this test in a folder of their own on the shared filesystem."""
    monkeypatch.setenv("FT_RUNS_DIR", str(shared_tmp / "runs"))
    return shared_tmp / "runs"


def submit(*args: str) -> dict:
    result = ft("submit", "--json", *args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def wait_finished(run_id: str) -> dict:
    def finished():
        shown = json.loads(ft("status", run_id, "--json").stdout)
        return shown if shown["job"] and shown["state"] in {"COMPLETED", "FAILED", "CANCELLED"} else None

    return wait_for(f"run {run_id} to finish", finished, timeout=120, interval=1)


@pytest.mark.slurm_matrix
def test_two_node_run_goes_through_to_completion_with_status_and_logs(lab, runs_dir):
    run = submit(str(TINY), "--preflight")

    status = wait_finished(run["run_id"])
    assert status["state"] == "COMPLETED"
    (attempt,) = status["attempts"]
    assert attempt["job_id"] == run["job_id"] and len(set(attempt["nodes"])) == 2
    job_log = ft("logs", run["run_id"])
    assert job_log.returncode == 0 and f"ft: job {run['job_id']}" in job_log.stdout
    as_json = [json.loads(line) for line in ft("logs", run["run_id"], "--json").stdout.splitlines()]
    assert "".join(chunk["text"] for chunk in as_json) == job_log.stdout
    for node in attempt["nodes"]:
        node_log = ft("logs", run["run_id"], "--node", node)
        assert "preflight passed" in node_log.stdout, node_log.stdout + node_log.stderr
    listed = json.loads(ft("ls", "--json").stdout)
    assert [entry["run_id"] for entry in listed] == [run["run_id"]]
    table = ft("status", run["run_id"])
    assert "COMPLETED" in table.stdout and "attempts" in table.stdout


@pytest.mark.slurm_matrix
def test_a_script_rendered_then_submitted_with_plain_sbatch_shows_in_ls_and_status(lab, runs_dir, shared_tmp):
    script = shared_tmp / "by-hand.sbatch"
    rendered = ft("render", str(TINY), "--preflight", "--run-id", "by-hand", "-o", str(script))
    assert rendered.returncode == 0, rendered.stderr
    listed = json.loads(ft("ls", "--json").stdout)
    assert [(entry["run_id"], entry["jobs"], entry["job"]) for entry in listed] == [("by-hand", [], None)]

    held = commands.run(["sbatch", "--parsable", "--hold", str(script)]).stdout.strip().split(";")[0]
    pending = json.loads(ft("status", "by-hand", "--json").stdout)
    assert (pending["job"]["job_id"], pending["state"]) == (held, "PENDING")  # found by the script's comment
    commands.run(["scontrol", "release", held])

    status = wait_finished("by-hand")
    assert status["state"] == "COMPLETED"
    assert [job["job_id"] for job in status["jobs"]] == [held]  # the job recorded itself as it started
    assert [attempt["job_id"] for attempt in status["attempts"]] == [held]


def test_slurm_runs_exactly_the_script_ft_render_writes(lab, runs_dir):
    run = submit(str(TINY), "--preflight")
    kept = (Path(run["run_dir"]) / "job.sbatch").read_text()

    in_slurm = commands.run(["scontrol", "write", "batch_script", run["job_id"], "-"]).stdout
    rendered = ft("render", str(TINY), "--preflight", "--run-id", run["run_id"])

    assert rendered.returncode == 0, rendered.stderr
    assert in_slurm == kept == rendered.stdout
    wait_finished(run["run_id"])


def test_same_idempotency_key_from_two_shells_at_once_submits_once(lab, runs_dir):
    key = f"test-key-{runs_dir.parent.name}"
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: submit(str(TINY), "--preflight", "--idempotency-key", key), range(2)))

    assert results[0]["run_id"] == results[1]["run_id"]
    assert sorted(r["created"] for r in results) == [False, True]
    assert len(list(runs_dir.glob("*/run.json"))) == 1
    assert f"ft-key={key}" in job_fields(results[0]["job_id"]).get("Comment", "")
    again = submit(str(TINY), "--preflight", "--idempotency-key", key)
    assert again["run_id"] == results[0]["run_id"] and again["created"] is False
    wait_finished(results[0]["run_id"])


def test_hostile_strings_arrive_on_every_node_and_never_execute(lab, runs_dir, shared_tmp):
    marker = shared_tmp / "pwned"
    recipe = tiny_recipe()
    recipe["env"] = {"HOSTILE_Q": "it's \"quoted\"; echo hi", "HOSTILE_SUB": f"$(touch {marker})",
                     "HOSTILE_TICK": f"`touch {marker}`", "HOSTILE_NL": f"one\ntwo $(touch {marker})"}
    recipe["data"]["train"] = f"/data/o'neil; $(touch {marker}).jsonl"
    path = shared_tmp / "hostile.yaml"
    path.write_text(yaml.safe_dump(recipe))

    run = submit(str(path), "--preflight")

    assert wait_finished(run["run_id"])["state"] == "COMPLETED"
    assert not marker.exists()
    records = list((Path(run["run_dir"]) / "preflight").glob("*"))
    assert len(records) == 2
    for record in records:
        assert json.loads(record.read_text())["env"] == recipe["env"]
    spec = RunLayout(Path(run["run_dir"])).read_spec()
    assert spec.recipe.data.train == recipe["data"]["train"]


def test_a_job_slurm_refuses_leaves_no_run_behind(lab, runs_dir, shared_tmp):
    recipe = tiny_recipe()
    recipe["data"]["train"] = str(REPO / "recipes" / "data" / "tiny-sft.jsonl")
    recipe["resources"]["account"] = "no-such-account"
    path = shared_tmp / "bad-account.yaml"
    path.write_text(yaml.safe_dump(recipe))

    result = ft("submit", str(path))

    assert result.returncode != 0
    assert "sbatch refused the job" in result.stderr and "account" in result.stderr.lower()
    assert not list(runs_dir.glob("*/run.json"))


@pytest.mark.slurm_matrix
def test_every_state_source_agrees_on_a_finished_job(lab, runs_dir):
    run = submit(str(TINY), "--preflight")
    wait_finished(run["run_id"])
    client = CliSlurmClient()

    def finished(source):
        return lambda: (lambda job: job if job and job.finished else None)(source(run["job_id"]))

    # slurmdbd hears of a job's end a moment after the controller: wait for its final record.
    from_sacct = wait_for("sacct to record the job's end", finished(client._from_sacct), timeout=60)
    from_jobcomp = wait_for("the completion log to record the job", finished(client._from_jobcomp), timeout=60)
    assert from_sacct.state == from_jobcomp.state == "COMPLETED"
    assert from_sacct.exit_code == 0
    assert RunStore(runs_dir).load(run["run_id"]).latest_job == run["job_id"]


def test_python_api_submits_waits_and_reads_logs(lab, runs_dir):
    import toolkit

    run = toolkit.submit(TINY, preflight=True, idempotency_key=f"api-{runs_dir.parent.name}")
    final = run.wait(timeout=120, poll=1)

    assert final.state == "COMPLETED"
    assert f"ft: job {run.job_id}" in run.log()
    assert toolkit.run(run.run_id).state == "COMPLETED"
    again = toolkit.submit(TINY, preflight=True, idempotency_key=f"api-{runs_dir.parent.name}")
    assert again.run_id == run.run_id


def test_logs_follow_streams_until_the_job_ends(lab, runs_dir):
    run = submit(str(TINY), "--preflight")
    followed = ft("logs", run["run_id"], "-f")
    assert followed.returncode == 0
    assert f"ft: job {run['job_id']}" in followed.stdout
    assert json.loads(ft("status", run["run_id"], "--json").stdout)["state"] == "COMPLETED"


def test_submit_refuses_data_that_would_fail_and_submits_nothing(lab, runs_dir, shared_tmp):
    data = shared_tmp / "broken.jsonl"
    good = [json.dumps({"prompt": f"q{i}", "completion": f" a{i}"}) for i in range(150)]
    good[40] = '{"prompt": "unterminated'
    data.write_text("\n".join(good) + "\n")
    recipe = tiny_recipe()
    recipe["data"]["train"] = str(data)
    path = shared_tmp / "bad-data.yaml"
    path.write_text(yaml.safe_dump(recipe))
    queue = ["squeue", "--noheader", "--format=%i", f"--partition={','.join(lab.partitions)}"]  # this slice's
    queued_before = commands.run(queue).stdout.split()

    refused = ft("submit", str(path))

    assert refused.returncode == 1
    assert f"unparseable x1: {data}:41" in refused.stderr and "nothing was submitted" in refused.stderr
    assert not list(runs_dir.glob("*/run.json"))
    assert commands.run(queue).stdout.split() == queued_before
    forced = submit(str(path), "--skip-validation", "--preflight")
    assert forced["created"]
    wait_finished(forced["run_id"])


@pytest.mark.slurm_matrix
def test_cancel_stops_the_run_and_says_so_in_json(lab, runs_dir):
    run = submit(str(TINY))
    cancelled = ft("cancel", run["run_id"], "--json")
    assert cancelled.returncode == 0, cancelled.stderr
    assert json.loads(cancelled.stdout) == {"run_id": run["run_id"], "cancelled_job": run["job_id"]}
    assert wait_finished(run["run_id"])["state"] == "CANCELLED"
