"""ft's daemons are restarted when ft's code they loaded changes: the record of that code
(toolkit/base/code_files.py) and the lab status that reads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from toolkit.base.code_files import digest, runs_old_code
from toolkit.lab.manifest import LabDaemon
from toolkit.lab.status import daemon_status

REPO = Path(__file__).resolve().parents[2]


def record_of(module: str) -> dict:
    """As the Ansible roles take it: a fresh interpreter importing the daemon's module."""
    found = subprocess.run([sys.executable, "-m", "toolkit.base.code_files", module], capture_output=True, text=True,
                           check=True, cwd=REPO)
    return json.loads(found.stdout)


def test_a_daemons_record_lists_the_ft_files_it_loads_and_nothing_else():
    signer = record_of("toolkit.services.signer")
    files = [Path(file) for file in signer["files"]]
    assert REPO / "toolkit" / "services" / "signer.py" in files
    assert REPO / "toolkit" / "base" / "privileges.py" in files
    assert all(file.is_relative_to(REPO / "toolkit") for file in files)
    # The signer is not the exporter: the exporter's module (and what only it loads) is not listed.
    assert REPO / "toolkit" / "services" / "cluster_metrics.py" not in files
    exporter = record_of("toolkit.services.cluster_metrics")
    assert REPO / "toolkit" / "cluster" / "profile.py" in map(Path, exporter["files"])  # imported at the top
    assert signer["digest"] == digest(signer["files"]) and not runs_old_code_of(signer)


def runs_old_code_of(record: dict) -> bool:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "daemon.code"
        path.write_text(json.dumps(record))
        return runs_old_code(str(path))


def test_a_changed_missing_or_renamed_file_and_a_bad_record_all_mean_old_code(tmp_path):
    first, second = tmp_path / "a.py", tmp_path / "b.py"
    first.write_text("A = 1\n")
    second.write_text("B = 2\n")
    record = {"files": [str(first), str(second)], "digest": digest([str(first), str(second)])}
    assert not runs_old_code_of(record)
    os.utime(first, (0, 0))  # touched, not changed: the same code
    assert not runs_old_code_of(record)
    first.write_text("A = 3\n")
    assert runs_old_code_of(record)
    first.write_text("A = 1\n")
    assert not runs_old_code_of(record)
    second.unlink()
    assert runs_old_code_of(record)
    second.write_text("B = 2\n")
    assert runs_old_code_of({"files": [str(second), str(first)], "digest": record["digest"]})  # order is part of it
    for broken in ("", "{", "[]", '{"files": [], "digest": null}', '{"files": "a.py", "digest": "x"}'):
        (tmp_path / "bad.code").write_text(broken)
        assert runs_old_code(str(tmp_path / "bad.code")), broken
    assert runs_old_code(str(tmp_path / "missing.code"))


def test_a_user_who_cannot_read_the_code_cannot_tell_and_says_nothing():
    with tempfile.TemporaryDirectory() as scratch:  # /tmp: a folder another user can reach
        Path(scratch).chmod(0o755)
        said_to_nobody(Path(scratch))


def said_to_nobody(tmp_path: Path) -> None:
    code = tmp_path / "module.py"
    code.write_text("X = 1\n")
    record = tmp_path / "daemon.code"
    record.write_text(json.dumps({"files": [str(code)], "digest": "0" * 64}))  # stale, to root
    record.chmod(0o644)
    code.chmod(0o600)  # root's alone
    assert runs_old_code(str(record))

    def as_nobody(path: Path) -> str:
        found = subprocess.run(
            ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", sys.executable, "-c",
             "import sys; from toolkit.base.code_files import runs_old_code; print(runs_old_code(sys.argv[1]))",
             str(path)],
            capture_output=True, text=True, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": os.environ["PATH"]})
        assert found.returncode == 0, found.stderr
        return found.stdout.strip()

    assert as_nobody(record) == "False"  # the file is unreadable to nobody: no false alarm
    code.chmod(0o644)
    assert as_nobody(record) == "True"  # readable, and changed since the record: said
    record.chmod(0o600)
    assert as_nobody(record) == "False"  # nor can a user who may not read the record tell


def test_the_lab_status_says_a_running_daemon_runs_old_code_and_only_a_running_one(tmp_path):
    code = tmp_path / "module.py"
    code.write_text("X = 1\n")
    record = tmp_path / "daemon.code"
    record.write_text(json.dumps({"files": [str(code)], "digest": digest([str(code)])}))
    pidfile = tmp_path / "daemon.pid"
    pidfile.write_text(f"{os.getpid()}\n")  # this test's own process stands in for the daemon
    daemon = LabDaemon("ft-signer", os.path.realpath(sys.executable), str(pidfile), code=str(record))

    assert daemon_status(daemon).running and not daemon_status(daemon).stale
    code.write_text("X = 2\n")
    assert daemon_status(daemon).stale
    assert not daemon_status(LabDaemon("ft-signer", os.path.realpath(sys.executable), str(pidfile))).stale
    pidfile.write_text("999999999\n")
    assert not daemon_status(daemon).running and not daemon_status(daemon).stale
