"""The warm template (toolkit/launch/warm.py): a real template process that imports the real training
runtime, and ranks forked from it for a launcher (this test process) through warm.spawn. A rank that
must stay alive waits on the compiled-op lock this test holds (toolkit/train/compiled_ops.prepare,
the first thing a rank does that can wait); Slurm is not needed here: the lab tests run every ft
training run through the templates."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.run_specs import run_spec, write_run_spec
from toolkit.job.supervise import warm_command
from toolkit.launch import warm
from toolkit.runs import exits
from toolkit.runs.layout import RunLayout

REPO = Path(__file__).resolve().parents[2]
JOB = {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0", "SLURMD_NODENAME": "node-a"}


def wait_for(probe, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {timeout:.0f} s")


def start_template(folder: Path) -> dict:
    log = folder / "template.log"
    run_dir = folder / "job-run"  # the job's run: its spec says the backend (gloo: CPU ranks)
    run_dir.mkdir(mode=0o700)
    write_run_spec(run_dir, run_spec(nodes=2))
    env = dict(os.environ, TMPDIR=str(folder), FT_RUN_DIR=str(run_dir), **JOB)
    with open(log, "w") as output:
        process = subprocess.Popen([sys.executable, "-m", "toolkit.launch.warm"], env=env, cwd=REPO, stdout=output,
                                   stderr=subprocess.STDOUT)
    wait_for(lambda: "serving ranks" in log.read_text() or process.poll() is not None, 240, "the template's start")
    assert process.poll() is None, log.read_text()
    return {"folder": folder, "process": process, "log": log}


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    started = start_template(tmp_path_factory.mktemp("warm"))
    yield started
    started["process"].kill()
    started["process"].wait(timeout=30)


@pytest.fixture
def launcher(template, monkeypatch, tmp_path):
    """This process as a launcher of the template's node, with a run folder and a rank log."""
    for name, value in {**JOB, "TMPDIR": str(template["folder"]), warm.WANTED: "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(warm, "_cold", False)
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    write_run_spec(run_dir, run_spec(nodes=2, site={"shared_root": str(run_dir.parent)}))
    locks = tmp_path / "extensions"
    locks.mkdir()
    return {"run_dir": run_dir, "extensions": locks, "log": tmp_path / "rank-1.log"}


def rank_env(launcher, **extra) -> dict[str, str]:
    return dict(os.environ, RANK="1", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="9",
                FT_RUN_DIR=str(launcher["run_dir"]),
                TORCH_EXTENSIONS_DIR=str(launcher["extensions"]), **extra)


def spawn(launcher, env) -> tuple[warm.WarmWorker, int, list[str]]:
    said: list[str] = []
    read_end, write_end = os.pipe()
    with open(launcher["log"], "a") as log:
        worker = warm.spawn(env, log.fileno(), write_end, "FT_PROGRESS_FD", say=said.append)
    os.close(write_end)
    assert worker is not None, said
    return worker, read_end, said


def open_files(pid: int) -> set[str]:
    """What a process's descriptors lead to now; one it closes while they are listed is left out (the
    forked rank closes the template's own descriptors just after the fork)."""
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(FileNotFoundError):
            held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return held


def held_compiled_op_lock(launcher):
    handle = open(launcher["extensions"] / ".ft-build.lock", "a")  # noqa: SIM115 - held across the test
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


def test_a_rank_forked_from_the_template_is_the_rank_its_launcher_asked_for(template, launcher):
    lock = held_compiled_op_lock(launcher)
    worker, progress, _ = spawn(launcher, rank_env(launcher))
    try:
        status = Path(f"/proc/{worker.pid}/status").read_text()
        assert f"PPid:\t{template['process'].pid}\n" in status  # forked by the template, not started anew
        # The progress pipe and the log are this launcher's own: the same pipe, the same file (the
        # environment it runs with shows in the next test: /proc shows only the template's own).
        # (The child takes them up just after the fork: waited for.)
        wait_for(lambda: os.readlink(f"/proc/{worker.pid}/fd/2") == str(launcher["log"]), 30, "the log as stderr")
        assert os.readlink(f"/proc/{worker.pid}/fd/1") == str(launcher["log"])
        pipe = f"pipe:[{os.fstat(progress).st_ino}]"
        wait_for(lambda: pipe in open_files(worker.pid), 30, "the launcher's progress pipe")
        assert worker.poll() is None  # waiting on the lock this test holds
        worker.kill()
        assert worker.wait(timeout=10) == -signal.SIGKILL
    finally:
        worker.kill()
        lock.close()
        os.close(progress)


def test_a_ranks_exit_status_and_output_come_back_to_its_launcher(template, launcher):
    (launcher["run_dir"] / "recipe.json").write_text("{not json")
    worker, progress, _ = spawn(launcher, rank_env(launcher))
    assert worker.wait(timeout=60) == exits.USER_ERROR  # a damaged spec: never restarted
    # The spec it read is the one in the run folder its launcher named.
    assert f"{launcher['run_dir']}/recipe.json does not hold a usable run spec" in launcher["log"].read_text()
    assert RunLayout(launcher["run_dir"]).read_exit_status() == exits.USER_ERROR
    assert os.read(progress, 100) == b""  # the rank's end closed its pipe
    os.close(progress)


def test_a_rank_does_not_outlive_its_launcher(template, launcher):
    lock = held_compiled_op_lock(launcher)
    worker, progress, _ = spawn(launcher, rank_env(launcher))
    try:
        assert warm.process_alive(worker.pid)
        worker.channel.sock.close()  # what the launcher's death does to its end
        wait_for(lambda: not warm.process_alive(worker.pid), 15, "the rank's end")
    finally:
        lock.close()
        os.close(progress)
    assert template["process"].poll() is None  # the template serves on


def test_without_a_working_template_the_launcher_starts_ranks_itself(launcher, monkeypatch, tmp_path):
    monkeypatch.setattr(warm, "SERVER_WAIT_S", 0.2)
    monkeypatch.setenv("SLURMD_NODENAME", "node-without-one")
    said: list[str] = []
    assert warm.spawn(rank_env(launcher), 1, 2, "FT_PROGRESS_FD", say=said.append) is None
    assert "starting ranks cold" in said[0]

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    open_folder = warm.socket_path().parent
    open_folder.mkdir(mode=0o777)
    open_folder.chmod(0o777)  # others may enter: a socket there may be anyone's
    monkeypatch.setattr(warm, "_cold", False)
    assert warm.spawn(rank_env(launcher), 1, 2, "FT_PROGRESS_FD", say=said.append) is None
    assert not warm.private_folder(open_folder)

    monkeypatch.setenv(warm.WANTED, "0")  # the supervisor started no template
    monkeypatch.setattr(warm, "_cold", False)
    assert warm.spawn(rank_env(launcher), 1, 2, "FT_PROGRESS_FD", say=said.append) is None
    assert len(said) == 2


def test_the_template_step_keeps_the_training_steps_options_on_one_node():
    command = ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
               "--output=/runs/x/logs/node-%N.log", "--container-image=nvcr.io#nvidia/pytorch:24.07-py3",
               "--mpi=pmix", "/opt/ft/bin/python", "-m", "toolkit.launch"]
    argv = warm_command(command, "n3", "/runs/x/logs/warm-%N.log")
    assert argv == ["srun", "--nodelist=n3", "--nodes=1", "--ntasks=1", "--overlap",
                    "--output=/runs/x/logs/warm-%N.log", "--open-mode=append",  # a failed template's log kept
                    "--container-image=nvcr.io#nvidia/pytorch:24.07-py3",
                    "--mpi=pmix", "/opt/ft/bin/python", "-m", "toolkit.launch.warm"]
    assert warm_command(["srun", "python", "train.py"], "n1", "x") is None  # not ft's launcher: no template


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def raw_request(path: Path, payload: bytes, fds: list[int] = ()) -> socket.socket:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(str(path))
    socket.send_fds(client, [payload], list(fds)) if fds else client.sendall(payload)
    return client


def framed(message) -> bytes:
    body = json.dumps(message).encode()
    return struct.pack("!I", len(body)) + body


def test_hostile_or_broken_requests_neither_end_the_template_nor_leak_into_it(template, launcher):
    path, pid = warm.socket_path(), template["process"].pid
    before = open_fds(pid)
    log = open(launcher["log"], "a")  # noqa: SIM115
    read_end, write_end = os.pipe()
    try:
        for payload in (framed(["a", "list"]), framed({"env": "not a dict"}), struct.pack("!I", 1 << 30),
                        framed({"env": {}})[:-3], struct.pack("!I", 200_000) + b"[" * 100_000 + b"]" * 100_000):
            raw_request(path, payload, [log.fileno(), write_end]).close()
        silent = raw_request(path, b"")  # says nothing: the template waits for it a bounded time only
        lock = held_compiled_op_lock(launcher)
        # A launcher that gives up at once (its request queued, its connection closed): no rank
        # outlives it.
        gone = raw_request(path, framed({"env": rank_env(launcher)}), [log.fileno(), write_end])
        gone.close()
        worker, progress, _ = spawn(launcher, rank_env(launcher))  # the next launcher is served
        assert worker.poll() is None
        worker.channel.sock.send(b"extra bytes")  # what no launcher sends: dropped, the rank is kept
        time.sleep(0.5)
        assert worker.poll() is None and template["process"].poll() is None
        worker.kill()
        assert worker.wait(timeout=10) == -signal.SIGKILL
        silent.close()
        lock.close()
        os.close(progress)
    finally:
        log.close()
        os.close(read_end)
        os.close(write_end)
    wait_for(lambda: open_fds(pid) <= before, 10, "the template's descriptors back to where they were")
    children = [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    assert children == []  # none left running, none left unreaped


def test_two_replies_in_one_read_are_two_messages():
    here, there = socket.socketpair()
    there.sendall(framed({"pid": 12}) + framed({"exit": 0}))
    channel = warm.Channel(here)
    assert channel.receive(1)[0] == {"pid": 12}
    assert channel.receive(1)[0] == {"exit": 0}
    there.close()
    assert channel.receive(1) == (None, [])


def test_slurms_signals_to_the_template_leave_its_ranks_to_their_launchers(tmp_path, launcher, monkeypatch):
    (tmp_path / "own").mkdir()
    own = start_template(tmp_path / "own")  # this one is stopped by the test
    monkeypatch.setenv("TMPDIR", str(own["folder"]))
    lock = held_compiled_op_lock(launcher)
    worker, progress, _ = spawn(launcher, rank_env(launcher))
    try:
        own["process"].send_signal(signal.SIGUSR2)  # the job's pre-timeout signal, and a job's end:
        own["process"].send_signal(signal.SIGTERM)  # the rank's launcher passes them on, not the template
        time.sleep(1)
        assert worker.poll() is None and own["process"].poll() is None
        assert not warm.socket_path().exists()  # no new ranks from a template told to end
        worker.kill()
        assert worker.wait(timeout=10) == -signal.SIGKILL
        assert own["process"].wait(timeout=15) == 0  # its last rank ended: so does it
    finally:
        lock.close()
        os.close(progress)
        own["process"].kill()


def test_a_rank_dies_with_its_template(tmp_path, launcher, monkeypatch):
    (tmp_path / "own").mkdir()
    own = start_template(tmp_path / "own")
    monkeypatch.setenv("TMPDIR", str(own["folder"]))
    lock = held_compiled_op_lock(launcher)
    worker, progress, _ = spawn(launcher, rank_env(launcher))
    try:
        own["process"].kill()  # what Slurm's end of the job does to the template's step
        wait_for(lambda: not warm.process_alive(worker.pid), 15, "the rank's end")
        assert worker.wait(timeout=10) == -signal.SIGKILL
    finally:
        lock.close()
        os.close(progress)
        own["process"].wait(timeout=10)


def test_the_templates_folder_is_named_by_the_jobs_secret(monkeypatch, tmp_path):
    """Another user who makes /tmp/ft-warm-<uid> first would turn this user's templates off: the
    folder's name holds a digest of the job's secret, which no one else knows."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setenv("FT_JOB_SECRET", "a" * 64)
    first = warm.socket_path().parent
    assert first.name.startswith(f"ft-warm-{os.getuid()}-") and len(first.name) > len(f"ft-warm-{os.getuid()}-") + 16
    (tmp_path / f"ft-warm-{os.getuid()}").mkdir(mode=0o777)  # the predictable name, taken: no matter
    assert warm.private_folder(first)
    monkeypatch.setenv("FT_JOB_SECRET", "b" * 64)
    assert warm.socket_path().parent != first  # another job: another folder
    monkeypatch.delenv("FT_JOB_SECRET")
    assert warm.socket_path().parent.name == f"ft-warm-{os.getuid()}"  # outside a rendered job


def test_a_per_job_tmpdir_too_long_for_a_socket_puts_the_template_in_tmp(monkeypatch, tmp_path):
    """A site's per-job TMPDIR can be long: a socket's path over sun_path's 108 bytes cannot be bound,
    and every rank would start cold. The template goes to /tmp then; a short TMPDIR is kept."""
    import socket

    long_tmpdir = tmp_path / ("per-job-scratch-" + "x" * 60)
    long_tmpdir.mkdir()
    for name, value in {"TMPDIR": str(long_tmpdir), "FT_JOB_SECRET": "a" * 64, "SLURM_JOB_ID": "123456789",
                        "SLURM_RESTART_COUNT": "2", "SLURMD_NODENAME": "gpu-node-0042"}.items():
        monkeypatch.setenv(name, value)
    path = warm.socket_path()
    assert len(os.fsencode(long_tmpdir / path.parent.name / path.name)) > warm.UNIX_PATH_MAX  # too long there
    assert path.parent.parent == Path("/tmp") and len(os.fsencode(path)) <= warm.UNIX_PATH_MAX
    assert warm.private_folder(path.parent)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(str(path))  # where it was before, this raised OSError: AF_UNIX path too long
    finally:
        path.unlink(missing_ok=True)
        path.parent.rmdir()
    monkeypatch.setenv("TMPDIR", "/var/tmp")
    assert warm.socket_path().parent.parent == Path("/var/tmp")


class Unforeseen(Exception):
    """What nobody foresaw: no narrower `except` names it."""


def listening_template(tmp_path, monkeypatch) -> warm.Template:
    """A template of this process's own, listening at its node's socket, without the signal handlers
    and wake-up pipe of a real one (this is the test's process): what accept() uses, and no more."""
    for name, value in {**JOB, "TMPDIR": str(tmp_path), warm.WANTED: "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("FT_JOB_SECRET", raising=False)  # the folder's short name: a socket's path is short
    monkeypatch.setattr(warm, "_cold", False)
    path = warm.socket_path()
    assert warm.private_folder(path.parent)
    template = warm.Template.__new__(warm.Template)
    template.path, template.listener = path, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    template.listener.bind(str(path))
    template.listener.listen(4)
    return template


def test_a_request_whose_handling_fails_unforeseen_is_dropped_and_the_template_serves_on(tmp_path, monkeypatch,
                                                                                          capsys):
    """warm.py's blind except in accept(): a request whose handling raises what nobody foresaw (not a
    socket's OSError) is dropped, its launcher starts its rank cold, and the template takes the next
    request (narrowed to OSError, this test fails: checked)."""
    import threading

    template = listening_template(tmp_path, monkeypatch)

    def breaks(connection):
        raise Unforeseen("a request broke in a way nobody foresaw")

    monkeypatch.setattr(template, "take_request", breaks)
    said, started = [], []
    read_end, write_end = os.pipe()
    monkeypatch.setattr(warm, "REPLY_WAIT_S", 10.0)
    launcher = threading.Thread(target=lambda: started.append(warm.spawn({}, write_end, write_end, "FT_PROGRESS_FD",
                                                                         say=said.append)), daemon=True)
    launcher.start()
    try:
        template.accept()
        launcher.join(30)
        # Closed under it (reset, its request unread): the launcher starts its rank itself.
        assert started == [None] and said[0].startswith(f"the warm template at {template.path} ")
        assert said[0].endswith(": starting ranks cold")
        assert "a request failed (Unforeseen: a request broke in a way nobody foresaw)" in capsys.readouterr().out
        taken = []
        monkeypatch.setattr(template, "take_request", taken.append)  # the next launcher's request
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(template.path))
            template.accept()
        assert len(taken) == 1
        taken[0].close()
    finally:
        template.close_listener()
        os.close(read_end)
        os.close(write_end)


def test_a_rank_that_raises_what_nobody_foresaw_prints_it_into_its_log(tmp_path, monkeypatch):
    """warm.py's `except BaseException` in the forked rank: whatever the rank raises, even what is not
    an Exception (KeyboardInterrupt's kin), its traceback is in the rank's log before the child exits 1
    (narrowed to Exception, this test fails: checked; so it does narrowed to OSError)."""

    class UnforeseenBase(BaseException):
        pass

    def become_rank(request, fds, launcher, template):
        sys.stderr = open(fds[0], "w", closefd=False)  # noqa: SIM115 - the rank's log as its stderr, as in become_rank
        raise UnforeseenBase("the rank broke in a way nobody foresaw")

    monkeypatch.setattr(warm, "become_rank", become_rank)
    monkeypatch.setattr(warm.Template, "forget", lambda self, keep: None)  # this template holds nothing to close
    template = warm.Template.__new__(warm.Template)
    log = tmp_path / "rank-0.log"
    here, there = socket.socketpair()
    read_end, write_end = os.pipe()
    try:
        with open(log, "w") as handle:
            child = template.fork({"env": {}}, [handle.fileno(), write_end], here, os.getpid())
        _, status = os.waitpid(child, 0)
    finally:
        for closing in (here, there):
            closing.close()
        os.close(read_end)
        os.close(write_end)
    assert os.waitstatus_to_exitcode(status) == 1
    text = log.read_text()
    assert "Traceback" in text and "UnforeseenBase: the rank broke in a way nobody foresaw" in text


def test_a_runtime_that_fails_to_load_unforeseen_leaves_the_ranks_to_start_cold(tmp_path, monkeypatch, capsys):
    """warm.py's blind except around the preload: the runtime's import failing in a way nobody foresaw
    (not an ImportError) is said, the template's socket is gone (its launchers start their ranks cold)
    and the template step ends cleanly (narrowed to ImportError or OSError, this test fails: checked)."""
    from toolkit.train import worker

    def preload():
        raise Unforeseen("the runtime broke in a way nobody foresaw")

    run_dir = tmp_path / "job-run"
    run_dir.mkdir(mode=0o700)
    write_run_spec(run_dir, run_spec(nodes=2))
    for name, value in {**JOB, "TMPDIR": str(tmp_path), "FT_RUN_DIR": str(run_dir)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("FT_JOB_SECRET", raising=False)  # the folder's short name: a socket's path is short
    monkeypatch.setattr(warm, "runtime_env", lambda env, backend: dict(os.environ))  # never re-executed: the test's
    monkeypatch.setattr(worker, "preload", preload)
    made: list[warm.Template] = []

    class Recorded(warm.Template):
        def __init__(self, path):
            super().__init__(path)
            made.append(self)

    monkeypatch.setattr(warm, "Template", Recorded)
    handled = (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
    previous = {signum: signal.getsignal(signum) for signum in handled}
    try:
        assert warm.main() == 0
    finally:  # the template's handlers and wake-up pipe, taken off the test's process again
        signal.set_wakeup_fd(-1)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for template in made:
            template.selector.close()
            os.close(template.wakeup_read)
            os.close(template.wakeup_write)
    assert len(made) == 1 and not made[0].path.exists() and made[0].listener.fileno() == -1
    assert ("could not load the training runtime (Unforeseen: the runtime broke in a way nobody foresaw): "
            "ranks start cold") in capsys.readouterr().out
