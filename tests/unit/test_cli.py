"""The `ft` command line: fast to start, clear on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from toolkit import __version__

HEAVY = ("torch", "transformers", "peft", "deepspeed")


def ft(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_version():
    result = ft("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"ft {__version__}"


RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "llama3-8b-lora-sft.yaml")


@pytest.mark.parametrize("argv", [["--help"], ["lab", "--help"], ["lab", "status", "--json"],
                                  ["recipe", "explain", RECIPE, "--cluster", "oci"],
                                  ["render", RECIPE, "--cluster", "hyperpod"], ["ls", "--json"],
                                  ["status", "no-such-run"], ["cluster", "ls"], ["cluster", "show", "lab"],
                                  ["doctor", "--cluster", "hyperpod", "--login-only"],
                                  ["report", "r1"], ["sync", "r1"], ["receipt", "verify", "r1"],
                                  ["compare", "r1", "r1-other"],
                                  ["receipt", "show", "r1"]])
def test_login_node_commands_never_import_the_training_stack(argv, tmp_path):
    (tmp_path / "r1").mkdir()
    (tmp_path / "r1" / "run.json").write_text(json.dumps({
        "run_id": "r1", "recipe_name": "r", "recipe_path": "/r.yaml", "cluster": "lab", "mode": "train",
        "created": 1.0, "idempotency_key": None, "jobs": []}))
    (tmp_path / "r1" / "metrics.jsonl").write_text('{"step": 1, "time": 1795000000, "loss": 2.0}\n')
    probe = (
        "import sys\n"
        "from toolkit.cli.app import app\n"
        f"sys.argv = ['ft', *{argv!r}]\n"
        "try:\n    app()\nexcept (SystemExit, Exception):\n    pass\n"
        f"print('HEAVY=' + ','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "FT_LAB_STATE_DIR": str(tmp_path), "FT_RUNS_DIR": str(tmp_path)})
    assert "HEAVY=\n" in result.stdout, result.stdout + result.stderr


def test_status_without_a_lab_says_how_to_get_one(tmp_path):
    result = ft("lab", "status", env={"FT_LAB_STATE_DIR": str(tmp_path)})
    assert result.returncode == 1
    assert "there is no lab on this machine" in result.stderr
    assert "ft lab up" in result.stderr

    as_json = ft("lab", "status", "--json", env={"FT_LAB_STATE_DIR": str(tmp_path)})
    assert as_json.returncode == 1
    assert json.loads(as_json.stdout) == {"up": False, "healthy": False, "problems": ["no lab on this machine"]}


@pytest.mark.skipif(os.geteuid() != 0, reason="checks the flag after the root check")
@pytest.mark.parametrize("nodes", ["0", "33", "-1"])
def test_lab_up_rejects_an_impossible_node_count_before_doing_anything(nodes, tmp_path):
    result = ft("lab", "up", "--nodes", nodes, env={"FT_LAB_STATE_DIR": str(tmp_path)})
    assert result.returncode == 2
    assert f"--nodes {nodes} is out of range" in result.stderr
    assert "choose 1 to 32" in result.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_lab_up_rejects_a_non_number():
    result = ft("lab", "up", "--nodes", "four")
    assert result.returncode == 2
    assert "--nodes" in result.stderr


def test_lab_up_as_a_normal_user_explains_it_needs_root(monkeypatch, capsys):
    # The suite runs as root and this machine's Python is not readable by other users, so the
    # effective uid is faked here: the one stand-in in this file.
    from toolkit.cli import app

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    for argv, command in ((["lab", "up"], "ft lab up"), (["chaos", "kill", "some-run", "--rank", "0"], "ft chaos")):
        monkeypatch.setattr(sys, "argv", ["ft", *argv])
        with pytest.raises(SystemExit) as exited:
            app.main()
        assert exited.value.code == 1
        said = " ".join(capsys.readouterr().err.split())
        assert f"`{command}` needs root" in said and f"sudo {command}" in said  # the command that was run


def test_crash_of_an_unknown_node_names_the_real_ones(tmp_path):
    lab_json = tmp_path / "lab.json"
    lab_json.write_text(json.dumps({
        "cluster": "lab", "subnet": "10.213.7.0/24", "bridge": "ftlab0",
        "controller": {"name": "ctl", "address": "10.213.7.1"},
        "nodes": [{"name": "node1", "address": "10.213.7.11", "netns": "ftlab-node1", "gpus": 4}],
        "gpus_per_node": 4, "partitions": ["standard"], "slurm_conf": "/etc/slurm/slurm.conf",
        "shared_dir": str(tmp_path), "log_dir": str(tmp_path), "daemons": []}))
    if os.geteuid() != 0:
        pytest.skip("crash needs root")
    result = ft("lab", "crash", "node9", env={"FT_LAB_STATE_DIR": str(tmp_path)})
    assert result.returncode == 2
    assert "the lab has no node 'node9'" in result.stderr
    assert "lab nodes: node1" in result.stderr


def test_status_prices_a_finished_run_at_its_cluster_s_rate():
    from types import SimpleNamespace

    from toolkit.cli.runs import _cost

    finished = SimpleNamespace(run=SimpleNamespace(cluster="hyperpod"), summary={"gpu_hours": 2.0})
    assert _cost(finished) == " (about $24.58 at $12.29/GPU-hour)"
    assert _cost(SimpleNamespace(run=SimpleNamespace(cluster="lab"), summary={"gpu_hours": 2.0})) == ""
    assert _cost(SimpleNamespace(run=SimpleNamespace(cluster="gone"), summary={"gpu_hours": 2.0})) == ""


@pytest.mark.parametrize("hostile", ["x[red]y[/red]", "a[/]b", "tab\x1b[31mred\x1b[0m"])
def test_user_text_is_printed_as_written_never_as_markup_or_escapes(tmp_path, hostile):
    """A value from a recipe reaches the terminal as written: rich markup is not interpreted and
    escape sequences are made visible."""
    import yaml

    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "model": {"base": "tiny-llama"}, "data": {"train": "t.jsonl"},
                                      "env": {"MY_NOTE": hostile}}))
    result = ft("recipe", "explain", str(recipe), "--cluster", "lab", env={"COLUMNS": "300"})
    assert result.returncode == 0, result.stderr
    assert "\x1b" not in result.stdout
    shown = hostile.replace("\x1b", "\\x1b")
    assert shown in result.stdout


def run_of_job_7(runs: Path) -> Path:
    """A run record r1 of job 7, with its logs folder, for `ft logs`."""
    run = runs / "r1"
    (run / "logs").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": "r1", "recipe_name": "r", "recipe_path": "/r.yaml",
                                              "cluster": "lab", "mode": "train", "created": 1.0,
                                              "idempotency_key": None, "jobs": [{"job_id": "7", "submitted": 1.0}]}))
    return run


def test_logs_as_json_carry_the_log_text_exactly(tmp_path):
    run = run_of_job_7(tmp_path)
    (run / "logs" / "slurm-7.out").write_text("ft: job 7\nline ü two\n")
    result = ft("logs", "r1", "--json", env={"FT_RUNS_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    (chunk,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert chunk["text"] == "ft: job 7\nline ü two\n" and chunk["offset"] == 0
    plain = ft("logs", "r1", env={"FT_RUNS_DIR": str(tmp_path)})  # the job's log as it is, where to look on aside
    assert plain.stdout == "ft: job 7\nline ü two\n" and "ft logs r1 --rank 0" in plain.stderr


def test_a_fault_reads_as_a_sentence_in_ft_status():
    from toolkit.cli.runs import _fault_line

    lost = _fault_line({"time": 1_795_500_000, "event": "node_lost", "node": "node2", "reason": "no heartbeat for 5 s",
                        "marked_down": True})
    assert lost.endswith("node node2 lost (no heartbeat for 5 s), marked DOWN") and "True" not in lost
    host = _fault_line({"time": 1_795_500_000, "event": "node_lost", "node": "node1", "reason": "batch host lost",
                        "reported_by": "node2"})
    assert host.endswith("node node1 lost (batch host lost), reported by node2")
    assert _fault_line({"time": 1_795_500_000, "event": "restart", "restart": 2, "after": "exit 6"}).endswith(
        "restart 2 after exit 6")


@pytest.mark.timeout(30, method="thread")
@pytest.mark.parametrize("planted", ["fifo", "dev-zero", "folder"])
def test_logs_refuse_what_is_no_file_in_a_logs_place(tmp_path, planted):
    run = run_of_job_7(tmp_path)
    place = run / "logs" / "slurm-7.out"
    {"fifo": lambda: os.mkfifo(place), "dev-zero": lambda: place.symlink_to("/dev/zero"),
     "folder": place.mkdir}[planted]()
    result = ft("logs", "r1", env={"FT_RUNS_DIR": str(tmp_path)})  # neither blocks nor streams forever
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "is not a regular file" in " ".join(result.stderr.split())


def test_a_long_log_streams_whole_across_reads(tmp_path):
    run = run_of_job_7(tmp_path)
    text = "é" * (3 << 19) + "end\n"  # 3 MiB of two-byte characters: reads split some of them
    (run / "logs" / "slurm-7.out").write_text(text)
    result = ft("logs", "r1", env={"FT_RUNS_DIR": str(tmp_path)})
    assert result.returncode == 0 and result.stdout == text


@pytest.mark.parametrize("target", ["/dev/full", "/proc/self/status", "/proc/no-such-process/job.sbatch"])
def test_a_script_that_cannot_be_written_is_an_error_and_leaves_no_run_folder(tmp_path, target):
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny-lora-sft.yaml"
    result = ft("render", str(recipe), "--cluster", "lab", "--run-id", "unwritten", "-o", target,
                env={"FT_RUNS_DIR": str(tmp_path)})
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"cannot write {target}" in result.stderr and "-o ./job.sbatch" in result.stderr
    assert not (tmp_path / "unwritten").exists()


def test_status_and_logs_without_a_run_read_the_newest_one(tmp_path):
    """What a newcomer types right after `ft submit`: the newest run, said so on stderr (stdout stays
    the run's: --json parses)."""
    run_of_job_7(tmp_path)
    (tmp_path / "r1" / "logs" / "slurm-7.out").write_text("ft: job 7\n")
    logs = ft("logs", "--json", env={"FT_RUNS_DIR": str(tmp_path)})
    assert logs.returncode == 0, logs.stderr
    assert json.loads(logs.stdout)["text"] == "ft: job 7\n" and "the newest run" in logs.stderr
    empty = tmp_path / "none"
    empty.mkdir()
    nothing = ft("status", env={"FT_RUNS_DIR": str(empty)})
    assert nothing.returncode != 0 and "no runs in" in nothing.stderr and "ft submit" in nothing.stderr
