"""Run ids and records read from the command line or from disk are checked before use."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from toolkit.base.errors import FtError
from toolkit.runs.store import RunNotFound, RunStore


@pytest.mark.parametrize("run_id", ["../x", "a/b", "..", ".hidden", "", "x\ny", "-rf"])
def test_a_run_id_that_could_leave_the_runs_root_is_refused(tmp_path, run_id):
    with pytest.raises(FtError, match="is not a run id"):
        RunStore(tmp_path).run_dir(run_id)


def test_ft_status_of_a_path_like_id_reads_nothing_outside(tmp_path):
    outside = tmp_path / "x"
    outside.mkdir()
    (outside / "run.json").write_text(json.dumps({"run_id": "x", "jobs": [{"job_id": "1"}]}))
    runs = tmp_path / "runs"
    runs.mkdir()
    result = subprocess.run([sys.executable, "-m", "toolkit", "status", "../x", "--json"], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "FT_RUNS_DIR": str(runs)})
    assert result.returncode == 2 and "is not a run id" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("content", ["{torn", "[]", '{"run_id": "other"}', '{"run_id": "r1", "jobs": 5}'])
def test_a_damaged_run_record_is_a_clear_error(tmp_path, content):
    (tmp_path / "r1").mkdir()
    (tmp_path / "r1" / "run.json").write_text(content)
    with pytest.raises(RunNotFound):
        RunStore(tmp_path).load("r1")
    assert RunStore(tmp_path).list() == []  # one damaged record never breaks the listing


@pytest.mark.parametrize("entry", [{"key": "other-key", "run_id": "r1"}, {"key": "k1", "run_id": "../../etc"},
                                   {"key": "k1", "run_id": 7}, ["k1"]])
def test_a_key_index_entry_that_does_not_fit_is_ignored(tmp_path, entry):
    store = RunStore(tmp_path)
    store.remember_key("k1", "r1")
    store._key_path("k1", "json").write_text(json.dumps(entry))
    assert store.run_for_key("k1") is None


def test_files_ft_writes_are_private_whatever_the_umask(tmp_path):
    from toolkit.base.shared_dirs import write_atomically

    previous = os.umask(0)
    try:
        write_atomically(tmp_path / "run.json", "{}")
        write_atomically(tmp_path / "job.sbatch", "#!/bin/bash\n", mode=0o700)
    finally:
        os.umask(previous)
    assert (tmp_path / "run.json").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "job.sbatch").stat().st_mode & 0o777 == 0o700
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_idempotency_keys_are_per_user(tmp_path, monkeypatch):
    store = RunStore(tmp_path)
    store.remember_key("exp-42", "r1")
    assert (tmp_path / ".keys" / f"uid-{os.getuid()}").stat().st_mode & 0o777 == 0o700
    monkeypatch.setattr(os, "getuid", lambda: 4242)
    # Another user's key returns nothing of the first user's; and the folder their keys would go
    # in, made by somebody else (here: this test's real user), is refused.
    with pytest.raises(FtError, match=r"uid-4242 is a folder of .*not yours"):
        store.run_for_key("exp-42")


def test_a_torn_attempts_line_is_skipped_not_fatal(tmp_path):
    from toolkit.runs.status import read_attempts

    good = {"job_id": "5", "restart": 0, "nodes": ["node1"], "started": 1.0}
    (tmp_path / "attempts.jsonl").write_text(json.dumps(good) + "\n" + '{"job_id": "5", "rest' + "\n[1]\n"
                                             + json.dumps(good | {"restart": 1}) + "\n")
    assert [a["restart"] for a in read_attempts(tmp_path)] == [0, 1]


def test_a_symlink_loop_in_a_data_path_is_a_located_data_error(tmp_path):
    import yaml

    from toolkit.data.recipe_data import validate_recipe_data
    from toolkit.recipe.resolve import resolve

    (tmp_path / "loop.jsonl").symlink_to(tmp_path / "loop.jsonl")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "model": {"base": "tiny-llama"}, "data": {"train": "loop.jsonl"}}))
    (report,) = validate_recipe_data(resolve(recipe, "lab"))
    assert not report.ok and report.errors


def test_a_run_folder_is_created_private_with_its_logs_folder(tmp_path):
    run_dir = RunStore(tmp_path / "runs").create_run_dir("r1")
    assert run_dir.stat().st_mode & 0o077 == 0 and (run_dir / "logs").stat().st_mode & 0o077 == 0
    with pytest.raises(FileExistsError):  # a new run never reuses another's folder
        RunStore(tmp_path / "runs").create_run_dir("r1")
    assert RunStore(tmp_path / "runs").create_run_dir("r1", exist_ok=True) == run_dir  # `ft render -o` again
