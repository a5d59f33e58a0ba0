"""ft submits through submitit, by two of its private methods: `_make_submission_file_text`
(overridden, so the file submitit hands to sbatch is ft's rendered script) and `_submit_command`
(a submission with no pickled callable). A submitit release that changes either must fail here,
loudly, not submit a different script on a cluster. sbatch is a stand-in script here (recording the
file it was given): the lab tests submit through the real one."""

from __future__ import annotations

import inspect
import os
from pathlib import Path

import pytest
import submitit

from toolkit.submission import _sbatch

SCRIPT = "#!/bin/bash\n#SBATCH --job-name=ft-coupling\n# a path with 'quotes' and a\n# newline\necho ok\n"


def test_the_private_methods_ft_relies_on_are_there_with_their_signatures():
    make = inspect.signature(submitit.SlurmExecutor._make_submission_file_text)
    assert list(make.parameters) == ["self", "command", "uid"]
    submit = inspect.signature(submitit.SlurmExecutor._submit_command)
    assert list(submit.parameters)[:2] == ["self", "command"]


def test_submitit_hands_sbatch_exactly_ft_s_script_and_returns_its_job_id(tmp_path, monkeypatch):
    bin_dir, seen = tmp_path / "bin", tmp_path / "seen.sbatch"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f'#!/bin/bash\nfor arg; do last="$arg"; done\ncp "$last" {seen}\n'
                      'echo "Submitted batch job 4242"\n')
    sbatch.chmod(0o755)
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=coupling\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    job_id = _sbatch(run_dir, SCRIPT)

    assert job_id == "4242"
    assert Path(seen).read_text() == SCRIPT  # byte for byte: no submitit template, no pickle


def test_sbatch_variables_of_the_users_shell_never_override_the_scripts_directives(tmp_path, monkeypatch, capsys):
    """sbatch takes SBATCH_ACCOUNT (QOS, partition...) over #SBATCH lines: the job would run under an
    account ft did not check the quota of. The stand-in sbatch records what it was given."""
    bin_dir, seen = tmp_path / "bin", tmp_path / "env"
    bin_dir.mkdir()
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f'#!/bin/bash\nenv | grep ^SBATCH_ > {seen}\necho "Submitted batch job 7"\n')
    sbatch.chmod(0o755)
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=coupling\n")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    monkeypatch.setenv("SBATCH_ACCOUNT", "capped")
    monkeypatch.setenv("SBATCH_QOS", "ft-free")
    (tmp_path / "run").mkdir()

    assert _sbatch(tmp_path / "run", SCRIPT) == "7"

    assert seen.read_text() == ""  # sbatch saw none of them
    assert "SBATCH_ACCOUNT, SBATCH_QOS left out of sbatch's environment" in capsys.readouterr().err
    assert os.environ["SBATCH_ACCOUNT"] == "capped"  # the shell's own environment is left as it was


def test_a_submission_failing_in_a_way_nobody_foresaw_is_refused_naming_the_script(tmp_path, monkeypatch):
    """submission.py's blind except: not only submitit's FailedJobError or a CalledProcessError with
    sbatch's text; whatever the submission raises (a submitit release's new error, say) is a
    SubmitError naming the rendered script, never a traceback (narrowed to OSError, this test fails:
    checked)."""
    from toolkit.runs.layout import RunLayout
    from toolkit.submission import SubmitError

    class Unforeseen(Exception):
        pass

    def submit(self, command, *args, **kwargs):
        raise Unforeseen("submitit broke in a way nobody foresaw")

    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=coupling\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    monkeypatch.setattr(submitit.SlurmExecutor, "_submit_command", submit)
    (tmp_path / "run").mkdir()
    with pytest.raises(SubmitError, match="sbatch refused the job: submitit broke in a way nobody foresaw") as refused:
        _sbatch(tmp_path / "run", SCRIPT)
    assert str(RunLayout(tmp_path / "run").script) in refused.value.hint
