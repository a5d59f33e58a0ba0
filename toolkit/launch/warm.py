"""A warm template of the training runtime on every node of the job, so that a restart pays no imports.

Importing torch, transformers, peft and DeepSpeed takes 5-12 s on the lab's CPUs (each template's
log says how long), most of what a restart inside the allocation cost before (benchmarks/RECOVERY.md),
and seconds on any cluster. The
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
import hashlib
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

from toolkit.watch.stacks import process_state

# Training on CPUs (the lab): glibc hands each large freed buffer back to the kernel, and the next
# step faults it in again, zeroed. A third of a CPU step went to the kernel so (a 768x6 Llama: 20 s
# of 61 s); with the buffers kept in the heap the same loop ran 1.3-1.5x faster (benchmarks/TRAINING.md).
# The mmap threshold is glibc's largest; the heap keeps its peak, which every step reaches again.
CPU_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(16 << 30),
              "MALLOC_TOP_PAD_": str(256 << 20)}
WANTED = "FT_WARM"  # set by the supervisor for the training step when it started the warm step
SERVER_WAIT_S = 30.0  # how long a launcher waits for its node's template to listen
REPLY_WAIT_S = 600.0  # the first start waits while the template imports (as a cold rank would)
MAX_REQUEST = 1 << 20
PR_SET_PTRACER = 0x59616D61  # Yama: who may attach to this process (py-spy, for the hang dumps)
PR_SET_PDEATHSIG = 1  # the signal this process gets when its parent dies


def runtime_env(env: dict[str, str], backend: str) -> dict[str, str]:
    """What a rank's process must have from its first instruction: glibc reads its malloc
    settings, and DeepSpeed picks its accelerator, as they load."""
    if backend == "gloo":
        env.setdefault("DS_ACCELERATOR", "cpu")
        for name, value in CPU_MALLOC.items():  # the site's own settings win
            env.setdefault(name, value)
    return env


# The longest path a Unix socket binds to (sun_path's 108 bytes, the last a NUL): a longer one is
# refused, and the ranks would start cold.
UNIX_PATH_MAX = 107


def log(message: str) -> None:
    print(f"[ft-warm {socket.gethostname()} {time.strftime('%H:%M:%S')}] {message}", flush=True)


def socket_path(node: str | None = None) -> Path:
    """The node's template for this start of the job (a requeue keeps the job id: the restart
    count tells the incarnations apart). Node-local /tmp on a cluster; on the lab the nodes share
    one, and the node's name keeps them apart. In $TMPDIR where a socket's path fits there (a
    site's per-job TMPDIR can be long), else in /tmp."""
    node = node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    name = "{}.{}.{}.sock".format(os.environ.get("SLURM_JOB_ID", "0"), os.environ.get("SLURM_RESTART_COUNT", "0"),
                                  re.sub(r"[^A-Za-z0-9_.-]", "_", node))
    path = Path(os.environ.get("TMPDIR") or "/tmp") / folder_name() / name
    return path if len(os.fsencode(path)) <= UNIX_PATH_MAX else Path("/tmp") / folder_name() / name


def folder_name() -> str:
    """ft-warm-<uid>-<a digest of the job's secret>: a name another user cannot guess, so cannot
    make first (a folder of theirs at a name anyone could predict turned the templates off for the
    user it named). Without the job's secret (outside a rendered job), the plain ft-warm-<uid>."""
    secret = os.environ.get("FT_JOB_SECRET", "")
    if len(secret) < 32:
        return f"ft-warm-{os.getuid()}"
    digest = hashlib.sha256(b"ft-warm-folder\n" + secret.encode()).hexdigest()[:20]
    return f"ft-warm-{os.getuid()}-{digest}"


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


# -- messages: a length, then a JSON object; a request's descriptors ride with its first bytes -------
class Channel:
    """One connection's messages. What a read brings beyond a message is kept for the next one (the
    template's two replies may arrive in one read)."""

    def __init__(self, sock: socket.socket):
        self.sock, self.buffer = sock, b""

    def send(self, message: dict, fds: list[int] = ()) -> None:
        data = json.dumps(message).encode()
        packet = struct.pack("!I", len(data)) + data
        sent = socket.send_fds(self.sock, [packet], list(fds)) if fds else self.sock.send(packet)
        if sent < len(packet):
            self.sock.sendall(packet[sent:])

    def receive(self, timeout: float | None, max_fds: int = 0) -> tuple[dict | None, list[int]]:
        """The next message, and the descriptors that came with it; (None, []) at the connection's
        end. Within `timeout` seconds in all (0: only what has arrived; None: no limit), else
        TimeoutError or BlockingIOError. ValueError: not a message. Descriptors are closed on any
        error: nothing leaks into the ranks forked later."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fds: list[int] = []
        try:
            while True:
                message = self._take()
                if message is not None:
                    return message, fds
                self.sock.settimeout(None if deadline is None else max(deadline - time.monotonic(), 0))
                if max_fds and not fds:
                    data, fds, _, _ = socket.recv_fds(self.sock, 65536, max_fds)
                else:
                    data = self.sock.recv(65536)
                if not data:
                    if self.buffer:
                        raise ValueError("the connection ended inside a message")
                    for fd in fds:
                        os.close(fd)
                    return None, []
                self.buffer += data
                if deadline is not None and time.monotonic() > deadline and not self._whole():
                    raise TimeoutError("a message trickling in")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def _whole(self) -> bool:
        """Whether the buffer holds a whole message (ValueError: a length no message may have)."""
        if len(self.buffer) < 4:
            return False
        size = struct.unpack("!I", self.buffer[:4])[0]
        if size > MAX_REQUEST:
            raise ValueError(f"a message of {size} bytes")
        return len(self.buffer) >= 4 + size

    def _take(self) -> dict | None:
        if not self._whole():
            return None
        size = struct.unpack("!I", self.buffer[:4])[0]
        body, self.buffer = self.buffer[4:4 + size], self.buffer[4 + size:]
        try:
            message = json.loads(body)
        except RecursionError:
            raise ValueError("JSON nested too deep") from None
        if not isinstance(message, dict):
            raise ValueError("not a JSON object")
        return message


# -- the launcher's side -------------------------------------------------------------------------------
class WarmWorker:
    """A rank forked by the node's template: the parts of subprocess.Popen the launcher uses. The
    exit status comes over the connection (the rank is the template's child, not ours)."""

    def __init__(self, channel: Channel, pid: int):
        self.channel, self.pid, self.returncode = channel, pid, None
        self.args = [f"warm rank (pid {pid})"]

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._read(timeout=left)
        return self.returncode

    def _read(self, timeout: float | None) -> None:
        """The template's word on the rank, if it comes within `timeout` seconds."""
        try:
            message, _ = self.channel.receive(timeout)
        except (BlockingIOError, TimeoutError):
            return
        except (OSError, ValueError):
            message = None
        if message is None:  # the template is gone: its child with it, or soon (see serve())
            self.returncode = -signal.SIGKILL if not process_alive(self.pid) else self._orphaned()
        elif isinstance(message.get("exit"), int):
            self.returncode = message["exit"]
        if self.returncode is not None:
            self.channel.sock.close()

    def _orphaned(self) -> int:
        """The template died and left its child running: stop it, its exit status is lost."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, signal.SIGKILL)
        return -signal.SIGKILL

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # an exit already reported: the pid may be another process's now
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def process_alive(pid: int) -> bool:
    return process_state(pid) not in ("gone", "Z", "X")  # a zombie has ended: only its status is left


_cold = False  # this launcher found the template wanting once: its other ranks do not wait on it again


def spawn(env: dict[str, str], log_fd: int, progress_fd: int, progress_env: str, say=log) -> WarmWorker | None:
    """A rank from this node's template, or None (not started for this job, or not working: the
    caller starts the rank itself)."""
    global _cold
    if os.environ.get(WANTED) != "1" or _cold:
        return None
    path = socket_path()
    deadline = time.monotonic() + SERVER_WAIT_S
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    if not private_folder(path.parent) or not path.exists():
        _cold = True
        say(f"no warm template at {path}: starting ranks cold")
        return None
    channel = Channel(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    try:
        channel.sock.settimeout(SERVER_WAIT_S)
        channel.sock.connect(str(path))
        channel.send({"env": env, "cwd": os.getcwd(), "progress_env": progress_env}, [log_fd, progress_fd])
        reply, _ = channel.receive(REPLY_WAIT_S)
    except (OSError, ValueError) as exc:  # TimeoutError included: the template then kills what it forks
        reply, problem = None, f"did not answer ({exc})"
    else:
        problem = "closed the connection"
    if not reply or not isinstance(reply.get("pid"), int):
        channel.sock.close()
        _cold = True
        say(f"the warm template at {path} {problem}: starting ranks cold")
        return None
    return WarmWorker(channel, reply["pid"])


# -- the template's side -------------------------------------------------------------------------------
class Template:
    """One node's template: listens, forks a rank per request, reports each one's end. One thread:
    whatever a client sends, the loop goes on (a request must arrive whole within REQUEST_WAIT_S)."""

    REQUEST_WAIT_S = 2.0

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
        # Slurm signals every step of a job: the ranks' own launchers pass them on (a TERM makes
        # them checkpoint); the template only stops taking requests on TERM or INT.
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        for ignored in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
            signal.signal(ignored, signal.SIG_IGN)
        self.stopping = False

    def serve(self) -> None:
        self.selector.register(self.listener, selectors.EVENT_READ, "listen")
        self.selector.register(self.wakeup_read, selectors.EVENT_READ, "wakeup")
        while not (self.stopping and not self.children):
            if self.stopping and self.listener.fileno() >= 0:
                self.selector.unregister(self.listener)
                self.close_listener()  # the ranks running go on to their end
            for key, _ in self.selector.select(timeout=5.0):
                if key.data == "listen":
                    self.accept()
                elif key.data == "wakeup":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wakeup_read, 512)
                else:
                    self.launcher_gone(key.data)
            self.reap()
        self.close_listener()

    def accept(self) -> None:
        connection, _ = self.listener.accept()
        try:
            self.take_request(connection)
        except Exception as exc:  # noqa: BLE001 - one client's trouble never ends the template
            log(f"a request failed ({type(exc).__name__}: {exc})")
            connection.close()

    def take_request(self, connection: socket.socket) -> None:
        pid, uid, _ = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                struct.calcsize("3i")))
        if uid != os.getuid():
            connection.close()
            return
        channel = Channel(connection)
        request, fds = channel.receive(self.REQUEST_WAIT_S, max_fds=2)
        try:
            if request is None or len(fds) != 2 or not isinstance(request.get("env"), dict) or closed(connection):
                connection.close()  # not a request, or its launcher gave up meanwhile
                return
            child = self.fork(request, fds, connection, pid)
        finally:
            for fd in fds:
                os.close(fd)
        self.children[child] = connection
        connection.settimeout(self.REQUEST_WAIT_S)  # replies are a few bytes: never a wait
        try:
            channel.send({"pid": child})
        except OSError:  # the launcher is gone already: so is its rank
            kill_group(child)
            return
        self.selector.register(connection, selectors.EVENT_READ, child)

    def fork(self, request: dict, fds: list[int], connection: socket.socket, launcher: int) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        template = os.getpid()
        child = os.fork()
        if child:
            return child
        code = 1
        try:
            self.forget(connection)
            code = become_rank(request, fds, launcher, template)
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
        """The launcher's connection is readable: at its end (the launcher ended, or was killed with
        its step), its rank must not outlive it. Launchers send nothing after their request: any
        bytes are read and dropped."""
        connection = self.children.get(pid)
        if connection is None:
            return
        connection.setblocking(False)
        try:
            if connection.recv(4096):
                return
        except BlockingIOError:
            return
        except OSError:
            pass  # reset: gone as well
        kill_group(pid)
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
                Channel(connection).send({"exit": os.waitstatus_to_exitcode(status)})
            connection.close()

    def stop(self, *_) -> None:
        self.stopping = True

    def close_listener(self) -> None:
        if self.listener.fileno() >= 0:
            self.listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


def closed(connection: socket.socket) -> bool:
    """Whether the other end has gone (a request queued while the template imported, from a
    launcher that gave up or died meanwhile, must not become a rank)."""
    connection.setblocking(False)  # a socket with a timeout would wait for data despite MSG_DONTWAIT
    try:
        return connection.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def kill_group(pid: int) -> None:
    """A rank forked here and the processes of its session (it has its own: see become_rank)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def become_rank(request: dict, fds: list[int], launcher: int, template: int) -> int:
    """The forked child turns into the rank its launcher asked for: its own session (the template's
    step signals never reach it), its log as stdout and stderr, the rank's environment. It dies
    with the template (which ends on its own only once its ranks have): where Slurm tracks a
    step's processes by process group, a session of its own would otherwise outlive the job."""
    os.setsid()
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != template:  # the template died before that took hold
        return 1
    log_fd, progress_fd = fds
    prctl(PR_SET_PTRACER, launcher)  # Yama (ptrace_scope 1): the launcher's py-spy may read its stacks
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


def prctl(option: int, value: int) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(option, ctypes.c_ulong(value), 0, 0, 0)


def main() -> int:
    from toolkit.runs.layout import RunLayout, RunSpecError

    try:
        backend = RunLayout(Path(os.environ["FT_RUN_DIR"])).read_spec().site.distributed_backend
    except (RunSpecError, KeyError) as exc:
        log(f"no run spec to read ({exc}): no warm template (ranks start cold)")
        return 0
    wanted = runtime_env(dict(os.environ, PYTORCH_NVML_BASED_CUDA_CHECK="1"), backend)  # asking for GPUs must not
    if wanted != dict(os.environ):  # initialise CUDA; the rest is read as the process starts: again, with it
        os.execve(sys.executable, [sys.executable, "-m", "toolkit.launch.warm"], wanted)
    path = socket_path()
    if not private_folder(path.parent):
        log(f"{path.parent} is not a private folder of this user's: no warm template (ranks start cold)")
        return 0
    template = Template(path)
    began = time.monotonic()
    try:
        from toolkit.train import worker

        worker.preload()
    except Exception as exc:  # noqa: BLE001 - the ranks start cold: slower, not broken
        log(f"could not load the training runtime ({type(exc).__name__}: {exc}): ranks start cold")
        template.close_listener()
        return 0
    import torch

    if torch.cuda.is_initialized():
        log("CUDA was initialised while loading the runtime, and cannot cross a fork: ranks start cold")
        template.close_listener()
        return 0
    log(f"training runtime loaded in {time.monotonic() - began:.1f} s: serving ranks at {path}")
    template.serve()
    # Ended at once, without the interpreter's teardown of the runtime's modules (1.5-4 s on the lab's
    # CPUs, nothing to save): a requeued job completes, and may start again, once its last process
    # on every node is gone.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
