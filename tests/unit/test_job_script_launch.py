"""The job script's decision after a failed step launch, run for real in bash with stand-ins for
srun, scontrol and sleep (the only mocks: the lab test in tests/lab/test_training.py does it with
real Slurm). Only a node srun could not reach, and whose launcher never started, is marked down."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from toolkit.recipe.resolve import resolve
from toolkit.render.sbatch import RunPlacement, render

REPO = Path(__file__).resolve().parents[2]
COMMUNICATION = "Communication connection failure"

# srun: leaves the launch marks of $STARTED nodes, prints $SRUN_ERROR for every $UNREACHED node.
FAKE_SRUN = """#!/bin/bash
for node in $STARTED; do touch "$FT_LAUNCH_MARKS/$node"; done
for node in $UNREACHED; do
    echo "srun: error: Task launch for StepId=$SLURM_JOB_ID.0 failed on node $node: $SRUN_ERROR" >&2
done
exit 1
"""
FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
    "show hostnames") echo "$ALL_NODES" | tr ' ' '\\n' ;;
    "show config") echo "SlurmdTimeout           = 10 sec" ;;
    "show job") echo "JobId=7 JobName=job.sh JobState=PENDING Reason=BeginTime Restarts=1" ;;  # requeued
    *) echo "$*" >> "$CALLS" ;;
esac
"""

def hold_lifted(calls: Path) -> str | None:
    """The helper's update of job 7's begin time, once it came (it outlives the script)."""
    for _ in range(100):
        lines = calls.read_text().splitlines() if calls.exists() else []
        found = [line for line in lines if line.startswith("update JobId=7")]
        if found:
            return found[0]
        time.sleep(0.1)
    return None


def run_script(tmp_path: Path, started: str, unreached: str, error: str = COMMUNICATION,
               earlier_failures: int = 0, run_dir_mode: int = 0o700,
               run_dir_owner: int | None = None, srun: str = FAKE_SRUN,
               during=None, existing_run_dir: bool = False) -> tuple[subprocess.CompletedProcess, list[str], Path]:
    run_dir = tmp_path / "run"
    resolved = resolve(REPO / "recipes" / "tiny-lora-sft.yaml", "lab")
    # The script's decision is under test, not the watchdog's restarts in place (with their backoff
    # of 1, 2, 4... s, the default five took 34 s when every launcher had started).
    resolved.recipe.watchdog.max_restarts = 0
    script = render(resolved, RunPlacement("r1", str(run_dir)), login_python=sys.executable)
    (tmp_path / "job.sh").write_text(script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in {"srun": srun, "scontrol": FAKE_SCONTROL, "sleep": "#!/bin/bash\nexit 0\n"}.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    run_dir.mkdir(exist_ok=existing_run_dir)
    run_dir.chmod(run_dir_mode)
    if run_dir_owner is not None:
        os.chown(run_dir, run_dir_owner, run_dir_owner)
    if earlier_failures:  # lost with the same latest checkpoint as now, step 40
        (run_dir / "checkpoints.json").write_text('{"shared": {"step": 40, "at": 1}}')
        (run_dir / "launch-failures").write_text("".join(f"{n} 40 node9\n" for n in range(earlier_failures)))
    calls = tmp_path / "calls"
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-3]",
           "SLURM_JOB_NUM_NODES": "3", "SLURM_CPUS_ON_NODE": "2", "ALL_NODES": "node1 node2 node3", "STARTED": started,
           "UNREACHED": unreached, "SRUN_ERROR": error, "CALLS": str(calls)}
    process = subprocess.Popen(["bash", str(tmp_path / "job.sh")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env=env)
    if during:  # what Slurm does to the script meanwhile (a signal, say)
        during(process, run_dir)
    out, err = process.communicate(timeout=60)
    result = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    return result, calls.read_text().splitlines() if calls.exists() else [], run_dir


def test_an_unreachable_node_is_marked_down_with_the_run_named(tmp_path):
    result, calls, run_dir = run_script(tmp_path, started="node1 node3", unreached="node2")
    assert calls[0] == "update NodeName=node2 State=DOWN Reason=ft: lost before job 7 (run r1) started on it"
    assert (run_dir / "launch-failures").read_text() == "7 none node2\n"  # no checkpoint yet
    assert hold_lifted(tmp_path / "calls") == "update JobId=7 StartTime=now+1"  # requeued without Slurm's hold
    assert "node node2 was lost before the step started on it: marking it down" in result.stdout
    # Slurm requeues the job once the node is down; here (no Slurm) the wait ends and the job fails.
    assert result.returncode != 0 and "did not requeue job 7" in result.stdout


@pytest.mark.parametrize("error", ["Invalid job credential", "Prolog failed", "Zero Bytes were transmitted"])
def test_a_node_that_refused_the_step_is_not_marked_down(tmp_path, error):
    result, calls, run_dir = run_script(tmp_path, started="node1 node3", unreached="node2", error=error)
    assert calls == [] and not (run_dir / "launch-failures").exists()
    assert result.returncode == 1


def test_a_node_whose_launcher_started_is_not_lost(tmp_path):
    result, calls, _ = run_script(tmp_path, started="node1 node2 node3", unreached="node2")
    assert calls == [] and result.returncode == 1


def test_when_every_node_seems_lost_nothing_is_marked_down(tmp_path):
    result, calls, _ = run_script(tmp_path, started="", unreached="node1 node2 node3")
    assert calls == [] and "not a lost node" in result.stdout and result.returncode == 1


def test_a_node_lost_again_is_requeued_after_a_backoff(tmp_path):
    run_script(tmp_path, started="node1 node3", unreached="node2", earlier_failures=2)
    assert hold_lifted(tmp_path / "calls") == "update JobId=7 StartTime=now+60"


def test_requeues_stop_after_the_runs_budget(tmp_path):
    result, calls, _ = run_script(tmp_path, started="node1 node3", unreached="node2", earlier_failures=3)
    assert calls == [] and "not requeueing again" in result.stdout and result.returncode == 1


def test_losses_with_a_new_checkpoint_between_count_afresh(tmp_path):
    """A long run on a flaky cluster loses nodes now and then: the budget is for losses in a row
    without progress, not for the run's whole life."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # Five losses, each after a new checkpoint.
    (run_dir / "launch-failures").write_text("".join(f"{n} {10 * n} node9\n" for n in range(5)))
    (run_dir / "checkpoints.json").write_text('{"shared": {"step": 60, "at": 1}}')
    run_script(tmp_path, started="node1 node3", unreached="node2", existing_run_dir=True)
    assert hold_lifted(tmp_path / "calls") == "update JobId=7 StartTime=now+1"  # the first in a row: no backoff
    assert (run_dir / "launch-failures").read_text().splitlines()[-1] == "7 60 node2"


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a folder owned by another user")
@pytest.mark.parametrize("mode, owner", [(0o700, 4242), (0o777, None), (0o770, None)])
def test_a_run_directory_not_this_users_alone_stops_the_job_before_anything_runs(tmp_path, mode, owner):
    result, calls, run_dir = run_script(tmp_path, started="node1 node2 node3", unreached="",
                                        run_dir_mode=mode, run_dir_owner=owner)
    assert result.returncode == 2
    assert "is not yours alone" in result.stderr
    assert "rendezvous" not in result.stdout and not (run_dir / "recipe.json").exists()


def test_the_time_limit_signal_after_the_run_finished_requeues_nothing(tmp_path):
    """USR2 (the time limit near) as the run ends: the run is done, and a requeue would only start
    a job that has nothing to do."""
    import signal

    finishing = ('#!/bin/bash\ncase "$*" in *toolkit.train.warm) exec /bin/sleep 30 ;; esac\n'  # a template
                 'touch "$FT_RUN_DIR/done"\nexec /bin/sleep 30\n')  # training: the run ends, slow to exit

    def time_limit_near(process: subprocess.Popen, run_dir: Path) -> None:
        for _ in range(300):
            if (run_dir / "done").exists():
                break
            time.sleep(0.1)
        time.sleep(0.5)
        process.send_signal(signal.SIGUSR2)

    result, calls, _ = run_script(tmp_path, started="", unreached="", srun=finishing, during=time_limit_near)
    assert "has finished: not requeueing" in result.stdout, result.stdout + result.stderr
    assert result.returncode == 0 and not any(call.startswith("requeue") for call in calls)
