"""The job script itself, run for real in bash: what it does before it hands over to the job
(`python -m toolkit.job`, tested in test_job_controller.py): refuse a run directory that is not
this user's alone, write the run spec, and start the job with it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit.recipe.resolve import resolve
from toolkit.render.sbatch import RunPlacement, render

REPO = Path(__file__).resolve().parents[2]


def run_script(tmp_path: Path, run_dir_mode: int = 0o700, run_dir_owner: int | None = None,
               finished: bool = False) -> tuple[subprocess.CompletedProcess, Path]:
    run_dir = tmp_path / "r1"
    script = render(resolve(REPO / "recipes" / "tiny-lora-sft.yaml", "lab"), RunPlacement("r1", str(run_dir)),
                    login_python=sys.executable)
    (tmp_path / "job.sh").write_text(script)
    run_dir.mkdir()
    run_dir.chmod(run_dir_mode)
    if run_dir_owner is not None:
        os.chown(run_dir, run_dir_owner, run_dir_owner)
    if finished:
        (run_dir / "done").touch()
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "node[1-2]", "HOME": str(tmp_path),
           "PYTHONPATH": str(REPO)}  # this checkout's ft, wherever the interpreter was installed from
    result = subprocess.run(["bash", str(tmp_path / "job.sh")], capture_output=True, text=True, env=env, timeout=60,
                            cwd=tmp_path)
    return result, run_dir


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a folder owned by another user")
@pytest.mark.parametrize("mode, owner", [(0o700, 4242), (0o777, None), (0o770, None)])
def test_a_run_directory_not_this_users_alone_stops_the_job_before_anything_runs(tmp_path, mode, owner):
    result, run_dir = run_script(tmp_path, run_dir_mode=mode, run_dir_owner=owner)
    assert result.returncode == 2
    assert "is not yours alone" in result.stderr
    assert "rendezvous" not in result.stdout and not (run_dir / "recipe.json").exists()


def test_the_script_writes_the_spec_and_hands_over_to_the_job(tmp_path):
    """A finished run: the job (toolkit/job) reads the spec the script wrote, and runs nothing again."""
    result, run_dir = run_script(tmp_path, finished=True)
    assert result.returncode == 0, result.stderr
    assert "ft: run r1 finished already (job 7, restart 0): nothing to do" in result.stdout
    assert '"step": {' in (run_dir / "recipe.json").read_text()
    assert (tmp_path / "job.sh").read_text().rstrip().endswith(f"exec {sys.executable} -m toolkit.job")
