"""Every command over the corpus of broken and hostile inputs (tests/corpus, made by build.py):
the only acceptable outcomes are success or a clear error with a non-zero exit. No traceback, no
hang (a time limit per case), no payload run, no file written outside the test's own folder, and
bounded memory (a case may not raise the process's peak by more than MEMORY_BOUND). Commands run
in-process (typer's runner) so that 180+ cases fit in well under two minutes."""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from toolkit.base.errors import FtError
from toolkit.cli.app import app

CORPUS = Path(__file__).resolve().parents[1] / "corpus"
PWNED = Path("/tmp/ft-corpus-pwned")  # what the corpus's shell payloads would create
# The reviewer's 2 MB gzip took 4.2 GB; a bounded reader stays within a few tens of MiB of its peak.
MEMORY_BOUND = 256 << 20


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10  # KiB on Linux


@pytest.fixture(autouse=True)
def bounded_memory():
    """The peak only grows, so a case is caught when it needs MEMORY_BOUND more than any case before
    it (the first cases also pay for the imports and the tiny tokenizer, under the same bound)."""
    before = peak_rss()
    yield
    grown = peak_rss() - before
    assert grown < MEMORY_BOUND, f"the case raised the peak memory by {grown >> 20} MiB"


def tree_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        digest.update(str(path.relative_to(root)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def corpus_digest() -> str:
    return tree_digest(CORPUS)


@pytest.fixture
def sandbox(tmp_path, monkeypatch):
    """A cluster profile whose shared root is the test's own folder; runs there too."""
    clusters = tmp_path / "clusters.yaml"
    clusters.write_text(yaml.safe_dump({"corpus": {"extends": "lab", "shared_root": str(tmp_path / "shared")}}))
    monkeypatch.setenv("FT_CLUSTERS_FILE", str(clusters))
    monkeypatch.setenv("FT_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setenv("COLUMNS", "200")
    # Slurm as it is when its controller is down, answering at once: what the records hold is under
    # test, not how long this machine's Slurm takes to say it is away (9 s a call with the lab down).
    away = tmp_path / "slurm-away"
    away.mkdir()
    for command in ("squeue", "sacct", "scontrol", "sinfo", "sacctmgr", "sbatch", "scancel"):
        (away / command).write_text("#!/bin/sh\n"
                                    "echo 'error: Unable to contact slurm controller (connect failure)' >&2\nexit 1\n")
        (away / command).chmod(0o755)
    monkeypatch.setenv("PATH", f"{away}:{os.environ['PATH']}")
    PWNED.unlink(missing_ok=True)
    return tmp_path


def run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    error = result.exception
    if isinstance(error, FtError):  # the console script prints these and exits with their code
        return error.exit_code, result.output + str(error)
    assert error is None or isinstance(error, SystemExit), f"ft {' '.join(args)} crashed: {error!r}"
    return result.exit_code, result.output


def check_outcome(code: int, output: str, args: tuple) -> None:
    assert code in (0, 1, 2), f"ft {' '.join(args)} exited {code}"
    assert "Traceback" not in output, output[-2000:]
    assert not PWNED.exists(), f"ft {' '.join(args)} ran a payload"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("recipe", sorted(p.name for p in (CORPUS / "recipes").iterdir()))
def test_recipe_commands_over_the_corpus(sandbox, corpus_digest, recipe):
    path = str(CORPUS / "recipes" / recipe)
    if recipe.startswith("data-refused-"):  # a valid recipe whose data must be refused
        code, output = run("validate", path, "--cluster", "corpus", "--tokenizer", "tiny-llama")
        assert code != 0 and "Traceback" not in output, output[-1500:]
    elif not recipe.startswith("hostile-env-"):  # every other case is a recipe to refuse, naming the file
        cluster = () if recipe.startswith("bad-cluster-") else ("--cluster", "corpus")
        code, output = run("recipe", "explain", path, *cluster)
        assert code == 2 and recipe in output, output[-1500:]
    for args in (("recipe", "explain", path, "--cluster", "corpus"),
                 ("render", path, "--cluster", "corpus", "--run-id", "r1", "-o", str(sandbox / "job.sbatch")),
                 ("validate", path, "--cluster", "corpus", "--tokenizer", "tiny-llama")):
        check_outcome(*run(*args), args)
    assert tree_digest(CORPUS) == corpus_digest  # nothing written beside the inputs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("data", sorted(p.name for p in (CORPUS / "data").iterdir()))
def test_data_check_over_the_corpus(sandbox, data):
    args = ("data", "check", str(CORPUS / "data" / data), "--tokenizer", "tiny-llama", "--max-seq-len", "128")
    check_outcome(*run(*args), args)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("what", ["fifo", "folder", "symlink-loop", "missing"])
def test_paths_git_cannot_hold(sandbox, what):
    path = sandbox / "case.jsonl"
    {"fifo": lambda: os.mkfifo(path), "folder": path.mkdir, "symlink-loop": lambda: path.symlink_to(path),
     "missing": lambda: None}[what]()
    for args in (("data", "check", str(path)), ("recipe", "explain", str(path)), ("validate", str(path))):
        code, output = run(*args)
        check_outcome(code, output, args)
        assert code != 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("profile", sorted(p.name for p in (CORPUS / "profiles").iterdir()))
def test_profiles_over_the_corpus(monkeypatch, sandbox, profile):
    monkeypatch.setenv("FT_CLUSTERS_FILE", str(CORPUS / "profiles" / profile))
    recipe = str(CORPUS / "recipes" / "hostile-env-0.yaml")
    for args in (("render", recipe, "--cluster", "p", "--run-id", "r1", "-o", str(sandbox / "job.sbatch")),
                 ("recipe", "explain", recipe, "--cluster", "p")):
        code, output = run(*args)
        check_outcome(code, output, args)
        assert code == 2 and profile in output  # every profile in the corpus is one to refuse, by file
    assert not (sandbox / "job.sbatch").exists()


@pytest.mark.timeout(60)
def test_run_commands_over_damaged_run_records(monkeypatch, sandbox):
    runs = sandbox / "runs"
    shutil.copytree(CORPUS / "runs", runs)
    monkeypatch.setenv("FT_RUNS_DIR", str(runs))
    check_outcome(*run("ls", "--json"), ("ls",))
    for run_id in sorted(p.name for p in runs.iterdir()):
        for args in (("status", run_id, "--json"), ("logs", run_id)):
            check_outcome(*run(*args), args)
