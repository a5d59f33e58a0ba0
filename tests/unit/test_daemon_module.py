"""ft.cluster.daemon, the module that runs Slurm's daemons where systemd does not, run for real
through ansible-playbook against a small self-daemonizing program."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from toolkit.lab.provision import run_playbook

DAEMON = textwrap.dedent("""
    import os, sys, time
    pidfile = sys.argv[1]
    if os.fork():
        sys.exit(0)          # like slurmd: the parent returns once the child is on its own
    os.setsid()
    with open(pidfile + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(pidfile + ".tmp", pidfile)
    time.sleep(600)
""")


@pytest.fixture
def daemon(tmp_path):
    script = tmp_path / "toy_daemon.py"
    script.write_text(DAEMON)
    pidfile = tmp_path / "toy.pid"
    config = tmp_path / "toy.conf"
    config.write_text("v1\n")
    started: list[int] = []

    def apply(state="started", check=False, **extra):
        task = {"name": "toy daemon", "ft.cluster.daemon": {
            "name": "toy", "argv": [os.path.realpath(sys.executable), str(script), str(pidfile)],
            "pidfile": str(pidfile), "state": state, "config_files": [str(config)], "timeout": 10, **extra}}
        playbook = tmp_path / "play.yml"
        playbook.write_text(yaml.safe_dump([{"name": "toy", "hosts": "localhost", "gather_facts": False,
                                             "tasks": [task]}]))
        result = run_playbook(str(playbook), inventory="localhost,", check=check,
                              extra_vars={"ansible_connection": "local",
                                          "ansible_python_interpreter": sys.executable})
        assert result.ok, result.error
        pid = read_pid()
        if pid and pid != os.getpid():
            started.append(pid)
        return result

    def read_pid():
        try:
            return int(pidfile.read_text())
        except (OSError, ValueError):
            return None

    apply.pidfile, apply.config, apply.read_pid = pidfile, config, read_pid
    yield apply
    for pid in set(started):  # only the PIDs this test started
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"


def test_start_is_idempotent(daemon):
    assert daemon().changed == 1
    pid = daemon.read_pid()
    assert pid and alive(pid)

    assert daemon().changed == 0
    assert daemon.read_pid() == pid


def test_stale_pid_file_naming_another_program_is_replaced(daemon):
    other = subprocess.Popen(["sleep", "60"])  # a live PID, but not the daemon's program
    try:
        daemon.pidfile.write_text(str(other.pid))

        assert daemon().changed == 1
        assert daemon.read_pid() != other.pid
        assert alive(daemon.read_pid())
        assert other.poll() is None  # the unrelated process was left alone
    finally:
        other.kill()
        other.wait()


def test_config_changed_after_start_restarts_the_daemon(daemon):
    daemon()
    first = daemon.read_pid()
    time.sleep(1.1)  # the start time is known to about a second
    daemon.config.write_text("v2\n")
    os.utime(daemon.config, (time.time() + 2, time.time() + 2))

    assert daemon().changed == 1
    assert daemon.read_pid() != first
    assert not alive(first)


def test_stop_ends_the_daemon_and_removes_its_pid_file(daemon):
    daemon()
    pid = daemon.read_pid()

    assert daemon(state="stopped").changed == 1
    assert not alive(pid)
    assert not daemon.pidfile.exists()


def test_stop_of_a_stopped_daemon_changes_nothing(daemon):
    assert daemon(state="stopped").changed == 0


def test_check_mode_reports_the_start_without_starting(daemon):
    assert daemon(check=True).changed == 1
    assert daemon.read_pid() is None
