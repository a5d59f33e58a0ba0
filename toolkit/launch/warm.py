"""A warm template of the training runtime on every node of the job, so that a restart pays no imports.

Importing torch, transformers, peft and DeepSpeed takes a rank 9-19 s on the lab's CPUs (more than
half of a restart inside the allocation, benchmarks/RECOVERY.md) and seconds on any cluster. The
supervisor starts one long-lived step over every node of the allocation, spares included:

    srun --overlap --no-kill ... python -m toolkit.launch.warm

On each node it imports the runtime once (toolkit.train.worker.preload) and then serves that node's
launchers over a Unix socket in a folder of the user's alone: a launcher hands it a rank's
environment, its log and its progress pipe, and gets back a forked child that is that rank
(WarmWorker: the few things of subprocess.Popen that the launcher uses). A fork takes milliseconds;
the template itself never trains, so every start finds it as it was after the imports.

A rank's life stays its launcher's: the child's exit status goes back over the connection, and a
launcher that dies (its step stopped, its node's srun killed) closes the connection, which kills
the child. Anything wrong with the template (not started, failed to import, gone) costs nothing but
time: the launcher starts the rank as a new process, as without it.

Forking after the imports is safe: the template runs no thread of its own (the one other thread is
OpenBLAS's pool, started by numpy, which re-forms itself after a fork as DataLoader workers rely
on), and it touches no GPU: it checks that CUDA is not initialised before it serves (a CUDA
context cannot cross a fork).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import selectors
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

WANTED = "FT_WARM"  # set by the supervisor for the training step when it started the warm step
SERVER_WAIT_S = 30.0  # how long a launcher waits for its node's template to listen
REPLY_WAIT_S = 600.0  # the first start waits while the template imports (as a cold rank would)
MAX_REQUEST = 1 << 20
PR_SET_PTRACER = 0x59616D61  # Yama: who may attach to this process (py-spy, for the hang dumps)


def log(message: str) -> None:
    print(f"[ft-warm {socket.gethostname()} {time.strftime('%H:%M:%S')}] {message}", flush=True)


def socket_path(node: str | None = None) -> Path:
    """The node's template for this start of the job (a requeue keeps the job id: the restart
    count tells the incarnations apart). Node-local /tmp on a cluster; on the lab the nodes share
    one, and the node's name keeps them apart."""
    node = node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    name = "{}.{}.{}.sock".format(os.environ.get("SLURM_JOB_ID", "0"), os.environ.get("SLURM_RESTART_COUNT", "0"),
                                  re.sub(r"[^A-Za-z0-9_.-]", "_", node))
    return Path(os.environ.get("TMPDIR") or "/tmp") / f"ft-warm-{os.getuid()}" / name


def private_folder(folder: Path) -> bool:
    """A real folder of this user's that nobody else may enter: another user's socket there could
    be handed a rank's environment, or hand back a process of theirs."""
    with contextlib.suppress(FileExistsError, OSError):
        folder.mkdir(mode=0o700)
    try:
        info = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077


# -- messages: a length, then JSON; file descriptors ride with the first bytes -------------------------
def send_message(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    packet = struct.pack("!I", len(data)) + data
    sent = socket.send_fds(sock, [packet], list(fds)) if fds else sock.send(packet)
    if sent < len(packet):
        sock.sendall(packet[sent:])


def receive_message(sock: socket.socket, max_fds: int = 0) -> tuple[dict | None, list[int]]:
    """One message and the descriptors that came with it; (None, []) at the end of the connection."""
    if max_fds:
        data, fds, _, _ = socket.recv_fds(sock, 65536, max_fds)
    else:
        data, fds = sock.recv(65536), []
    if len(data) < 4:
        data += receive_exactly(sock, 4 - len(data)) if data else b""
        if len(data) < 4:
            for fd in fds:
                os.close(fd)
            return None, []
    size = struct.unpack("!I", data[:4])[0]
    if size > MAX_REQUEST:
        raise ValueError(f"a message of {size} bytes")
    body = data[4:]
    if len(body) < size:
        body += receive_exactly(sock, size - len(body))
    if len(body) != size:  # more than one message in one read is never sent: one request, then replies
        raise ValueError("a torn message")
    return json.loads(body), fds


def receive_exactly(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size > 0:
        chunk = sock.recv(min(size, 65536))
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


# -- the launcher's side -------------------------------------------------------------------------------
class WarmWorker:
    """A rank forked by the node's template: the parts of subprocess.Popen the launcher uses. The
    exit status comes over the connection (the rank is the template's child, not ours)."""

    def __init__(self, connection: socket.socket, pid: int):
        self.connection, self.pid, self.returncode = connection, pid, None
        self.args = [f"warm rank (pid {pid})"]

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read(timeout=None if left is None else max(left, 0.01))
        return self.returncode

    def _read(self, timeout: float | None = 0) -> None:
        """The template's word on the rank, if it came (timeout 0: do not wait for it)."""
        self.connection.settimeout(timeout)
        try:
            message, _ = receive_message(self.connection)
        except (BlockingIOError, TimeoutError):
            return
        except (OSError, ValueError):
            message = None
        if message is None:  # the template is gone: its child with it, or soon (see serve())
            self.returncode = -signal.SIGKILL if not process_alive(self.pid) else self._orphaned()
        elif isinstance(message.get("exit"), int):
            self.returncode = message["exit"]
        if self.returncode is not None:
            self.connection.close()

    def _orphaned(self) -> int:
        """The template died and left its child running: stop it, its exit status is lost."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, signal.SIGKILL)
        return -signal.SIGKILL

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def process_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def spawn(env: dict[str, str], log_fd: int, progress_fd: int, progress_env: str, say=log) -> WarmWorker | None:
    """A rank from this node's template, or None (not started for this job, or not working: the
    caller starts the rank itself)."""
    if os.environ.get(WANTED) != "1":
        return None
    path = socket_path()
    deadline = time.monotonic() + SERVER_WAIT_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    if not private_folder(path.parent) or not path.exists():
        say(f"no warm template at {path}: starting the rank cold")
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.settimeout(REPLY_WAIT_S)
        connection.connect(str(path))
        send_message(connection, {"env": env, "cwd": os.getcwd(), "progress_env": progress_env,
                                  "launcher": os.getpid()}, [log_fd, progress_fd])
        reply, _ = receive_message(connection)
    except (OSError, ValueError) as exc:
        connection.close()
        say(f"the warm template at {path} did not answer ({exc}): starting the rank cold")
        return None
    if not reply or not isinstance(reply.get("pid"), int):
        connection.close()
        say(f"the warm template at {path} could not start the rank ({(reply or {}).get('error', 'it closed')}): "
            "starting it cold")
        return None
    return WarmWorker(connection, reply["pid"])


# -- the template's side -------------------------------------------------------------------------------
class Template:
    """One node's template: listens, forks a rank per request, reports each one's end."""

    def __init__(self, path: Path):
        self.path = path
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # left by an earlier template of the same start (the out-of-memory retry)
        self.listener.bind(str(path))
        os.chmod(path, 0o600)
        self.listener.listen(64)  # requests wait here while the runtime imports
        self.children: dict[int, socket.socket] = {}  # pid -> its launcher's connection
        self.selector = selectors.DefaultSelector()
        self.wakeup_read, self.wakeup_write = os.pipe()
        os.set_blocking(self.wakeup_write, False)
        signal.set_wakeup_fd(self.wakeup_write)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the loop through the pipe
        self.stopping = False

    def serve(self) -> None:
        self.selector.register(self.listener, selectors.EVENT_READ, "listen")
        self.selector.register(self.wakeup_read, selectors.EVENT_READ, "wakeup")
        while not self.stopping:
            for key, _ in self.selector.select(timeout=5.0):
                if key.data == "listen":
                    self.accept()
                elif key.data == "wakeup":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wakeup_read, 512)
                else:
                    self.launcher_gone(key.data)
            self.reap()
        self.close()

    def accept(self) -> None:
        connection, _ = self.listener.accept()
        pid, uid, _ = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                struct.calcsize("3i")))
        if uid != os.getuid():
            connection.close()
            return
        try:
            connection.settimeout(5.0)
            request, fds = receive_message(connection, max_fds=2)
        except (OSError, ValueError) as exc:
            log(f"a request from pid {pid} could not be read ({exc})")
            connection.close()
            return
        if not request or len(fds) != 2 or not isinstance(request.get("env"), dict):
            for fd in fds:
                os.close(fd)
            connection.close()
            return
        child = self.fork(request, fds, connection, pid)
        for fd in fds:
            os.close(fd)
        self.children[child] = connection
        send_message(connection, {"pid": child})
        self.selector.register(connection, selectors.EVENT_READ, child)

    def fork(self, request: dict, fds: list[int], connection: socket.socket, launcher: int) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        child = os.fork()
        if child:
            return child
        code = 1
        try:
            self.forget(connection)
            code = become_rank(request, fds, launcher)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - the rank's own error, printed into its log
            import traceback

            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)

    def forget(self, keep: socket.socket) -> None:
        """In the child: none of the template's sockets, pipes or handlers."""
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.selector.close()
        self.listener.close()
        os.close(self.wakeup_read)
        os.close(self.wakeup_write)
        for connection in [*self.children.values(), keep]:
            connection.close()

    def launcher_gone(self, pid: int) -> None:
        """The launcher closed its connection (it ended, or was killed with its step): its rank
        must not outlive it."""
        connection = self.children.get(pid)
        if connection is None:
            return
        try:
            if connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                return  # not an end (launchers send nothing after their request)
        except BlockingIOError:
            return
        except OSError:
            pass  # reset: gone as well
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        self.selector.unregister(connection)

    def reap(self) -> None:
        for pid in list(self.children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 255 << 8
            if not done:
                continue
            connection = self.children.pop(pid)
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(connection)
            with contextlib.suppress(OSError):
                send_message(connection, {"exit": os.waitstatus_to_exitcode(status)})
            connection.close()

    def stop(self, *_) -> None:
        self.stopping = True

    def close(self) -> None:
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.listener.close()


def become_rank(request: dict, fds: list[int], launcher: int) -> int:
    """The forked child turns into the rank its launcher asked for: its own session (the template's
    step signals never reach it), its log as stdout and stderr, the rank's environment."""
    os.setsid()
    log_fd, progress_fd = fds
    allow_tracer(launcher)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    for fd in (null, log_fd):
        os.close(fd)
    env = {str(k): str(v) for k, v in request["env"].items()}
    env[str(request.get("progress_env") or "FT_PROGRESS_FD")] = str(progress_fd)
    os.environ.clear()
    os.environ.update(env)
    with contextlib.suppress(OSError, TypeError):
        os.chdir(request.get("cwd") or "/")
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)
    from toolkit.train import worker

    worker.main()
    return 0


def allow_tracer(pid: int) -> None:
    """Where Yama restricts ptrace (ptrace_scope 1), only a process's ancestors may read its stacks;
    this rank's launcher is not one (the template is): name it, for the hang dumps."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0)


def main() -> int:
    from toolkit.train.workers import runtime_env

    wanted = runtime_env(dict(os.environ, PYTORCH_NVML_BASED_CUDA_CHECK="1"))  # asking for GPUs must not
    if wanted != dict(os.environ):  # initialise CUDA; the rest is read as the process starts: again, with it
        os.execve(sys.executable, [sys.executable, "-m", "toolkit.launch.warm"], wanted)
    path = socket_path()
    if not private_folder(path.parent):
        log(f"{path.parent} is not a private folder of this user's: no warm template (ranks start cold)")
        return 0
    template = Template(path)
    signal.signal(signal.SIGTERM, template.stop)
    signal.signal(signal.SIGINT, template.stop)
    began = time.monotonic()
    try:
        from toolkit.train import worker

        worker.preload()
    except Exception as exc:  # noqa: BLE001 - the ranks start cold: slower, not broken
        log(f"could not load the training runtime ({type(exc).__name__}: {exc}): ranks start cold")
        template.close()
        return 0
    import torch

    if torch.cuda.is_initialized():
        log("CUDA was initialised while loading the runtime, and cannot cross a fork: ranks start cold")
        template.close()
        return 0
    log(f"training runtime loaded in {time.monotonic() - began:.1f} s: serving ranks at {path}")
    template.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
