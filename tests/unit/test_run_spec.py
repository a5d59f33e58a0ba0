"""The run spec a job reads (recipe.json): typed, bounded, and adding up, or a clear error that no
restart can fix; and the queue lookup that finds a rendered run's job before it starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.run_specs import run_spec, write_run_spec
from toolkit.recipe.run_spec import RunSpec
from toolkit.runs.layout import RunLayout, RunSpecError


def spec_dict(**derived) -> dict:
    data = run_spec(nodes=2).model_dump(mode="json")
    data["derived"].update(derived)
    return data


@pytest.mark.parametrize("derived, complaint", [
    ({"workers_per_node": 0}, "greater than or equal to 1"),
    ({"world_size": 3}, "is not resources.nodes x workers_per_node"),
    ({"gradient_accumulation": 5}, "should be 1"),
    ({"out_of_memory_micro_batch": 2}, "does not follow"),
    ({"world_size": "2"}, "valid integer"),
])
def test_a_spec_that_does_not_add_up_is_refused_with_the_field(tmp_path, derived, complaint):
    (tmp_path / "recipe.json").write_text(json.dumps(spec_dict(**derived)))
    with pytest.raises(RunSpecError, match=complaint) as raised:
        RunLayout(tmp_path).read_spec()
    assert raised.value.exit_code == 4 and "render the job script again" in raised.value.hint


def test_a_spec_that_is_no_regular_file_or_too_big_is_refused_without_waiting(tmp_path):
    layout = RunLayout(tmp_path)
    os.mkfifo(layout.spec)  # nobody writes it: reading must not block
    with pytest.raises(RunSpecError, match="unreadable"):
        layout.read_spec()
    layout.spec.unlink()
    layout.spec.symlink_to("/dev/zero")
    with pytest.raises(RunSpecError, match="unreadable"):
        layout.read_spec()
    layout.spec.unlink()
    layout.spec.write_text("{not json")
    with pytest.raises(RunSpecError, match="does not hold a usable run spec"):
        layout.read_spec()


def test_a_written_spec_reads_back_equal(tmp_path):
    spec = run_spec(nodes=2, watchdog={"max_restarts": 2}, env={"A": "1"})
    write_run_spec(tmp_path, spec)
    assert RunLayout(tmp_path).read_spec() == spec
    assert RunSpec.model_validate(spec.model_dump()) == spec


FAKE_SQUEUE = """#!/bin/bash
printf '%s\\n' '101|ft-run=alpha' '205|ft-run=alpha,ft-key=k1' 'junk' '7|xft-run=beta' '300|ft-key=ft-run=beta' \\
               '12|ft-run=gamma' ' 13|ft-run=gamma'
"""


def test_one_squeue_call_finds_the_newest_queued_job_of_every_run(tmp_path, monkeypatch):
    """squeue is a stand-in script here (the lab test submits a held job to the real one)."""
    from toolkit.slurm.client import CliSlurmClient

    fake = tmp_path / "bin" / "squeue"
    fake.parent.mkdir()
    fake.write_text(FAKE_SQUEUE)
    fake.chmod(0o755)
    (tmp_path / "slurm.conf").write_text("ClusterName=x\n")
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    assert CliSlurmClient().queued_runs() == {"alpha": "205", "gamma": "13"}


def test_ft_ls_lists_rendered_runs_when_slurm_does_not_answer(tmp_path):
    runs = tmp_path / "runs"
    env = dict(os.environ, FT_RUNS_DIR=str(runs), SLURM_CONF=str(tmp_path / "missing.conf"))
    script = tmp_path / "job.sbatch"
    rendered = subprocess.run([sys.executable, "-m", "toolkit", "render", "recipes/tiny-lora-sft.yaml", "--run-id",
                               "r1", "-o", str(script)], env=env, capture_output=True, text=True)
    assert rendered.returncode == 0, rendered.stderr
    listed = subprocess.run([sys.executable, "-m", "toolkit", "ls", "--json"], env=env, capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    assert [(run["run_id"], run["job"]) for run in json.loads(listed.stdout)] == [("r1", None)]


def test_a_spec_rendered_before_packing_and_compile_trains_unpacked_and_eager():
    """A job requeued across an upgrade reruns its old script: packing would change its steps an
    epoch (a resumed run would end early), so an old spec keeps both off."""
    golden = Path(__file__).resolve().parents[1] / "golden" / "tiny-lora-sft__lab.sbatch"
    spec = json.loads(golden.read_text().split("<<'FT_RECIPE_JSON'\n")[1].split("\nFT_RECIPE_JSON")[0])
    del spec["recipe"]["data"]["packing"], spec["recipe"]["training"]["compile"]
    old = RunSpec.model_validate(spec)
    assert old.recipe.data.packing is False and old.recipe.training.compile is False and not old.recipe.packed
