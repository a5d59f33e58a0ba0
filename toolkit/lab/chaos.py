"""Faults on purpose, on the lab: what `ft chaos` does to a running ft run, for users trying ft's
recovery and for the tests. A rank is found by its run and rank among the lab nodes' processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from toolkit.base.errors import FtError
from toolkit.lab.lifecycle import crash, require_root
from toolkit.lab.manifest import LabManifest, state_dir
from toolkit.lab.processes import netns_pids
from toolkit.runs.layout import RunLayout
from toolkit.runs.store import RunStore
from toolkit.runs.timeline import read_lines
from toolkit.slurm import commands
from toolkit.slurm import jobs as slurm_jobs


@dataclass(frozen=True)
class RankProcess:
    node: str
    pid: int


def run_folder(run_id: str) -> Path:
    """A lab run's folder (FT_RUNS_DIR where a test or benchmark keeps its own runs)."""
    from toolkit.cluster.profile import load_profile

    return RunStore.for_shared_root(load_profile("lab").shared_root).run_dir(run_id)


CHAOS_NEEDS_ROOT = "it signals processes on the lab's nodes and takes nodes and devices away"


def find_rank(run_dir: Path, rank: int) -> RankProcess:
    """The worker process of one rank of a run, where its launcher says it runs (ranks/<n>.json in
    the run folder), checked: a process of the run on that lab node."""
    require_root("ft chaos", CHAOS_NEEDS_ROOT)
    manifest = LabManifest.load()
    if manifest is None:
        raise FtError("there is no lab on this machine", hint="run `ft lab up` first")
    not_running = FtError(f"no rank {rank} of run {run_dir.name} is running on the lab",
                          hint="is the run training? (`ft status`; ranks start after the model loads)")
    try:
        place = json.loads(RunLayout(run_dir).rank_place(rank).read_text())
        node, pid = next(n for n in manifest.nodes if n.name == place["node"]), int(place["pid"])
        environ = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
    except (OSError, ValueError, KeyError, TypeError, StopIteration):
        raise not_running from None
    if pid not in netns_pids(node.netns) or f"FT_RUN_ID={run_dir.name}".encode() not in environ:
        raise not_running  # the record is older than the rank's last start
    return RankProcess(node.name, pid)


def hang_rank(run_dir: Path, rank: int) -> RankProcess:
    """Stop a rank (SIGSTOP): it holds its collectives, as a rank stuck in a driver call would."""
    found = find_rank(run_dir, rank)
    os.kill(found.pid, signal.SIGSTOP)
    return found


def kill_rank(run_dir: Path, rank: int) -> RankProcess:
    found = find_rank(run_dir, rank)
    os.kill(found.pid, signal.SIGKILL)
    return found


def crash_rank_node(run_dir: Path, rank: int) -> RankProcess:
    """Crash the node a rank runs on: every process of the node ends, slurmd included."""
    found = find_rank(run_dir, rank)
    crash(found.node)
    return found


def crash_batch_host(run_dir: Path) -> str:
    """Crash the node the run's job script runs on (its batch host; not a training node while the
    job holds a spare: toolkit/job/supervise.py keeps it as the last one). The node's name."""
    require_root("ft chaos", CHAOS_NEEDS_ROOT)
    starts = read_lines(RunLayout(run_dir).attempts, {"job_id": str})  # each start's, watchdog or not
    job = starts[-1]["job_id"] if starts else ""
    host = slurm_jobs.batch_host(job, commands.run)
    if host is None:
        raise FtError(f"run {run_dir.name} has no job running", hint="is the run training? (`ft status`)")
    crash(host)
    return host


def fail_gpu(run_dir: Path, rank: int) -> tuple[RankProcess, Path]:
    """A GPU falls off the bus on the node a rank runs on. The lab's GPUs are device files (gres.conf
    names them, as /dev/nvidiaN on a real node): one goes, and the node's own health check
    (HealthCheckProgram, every few seconds on the lab) drains it, as it would a real node; ft's
    watchdog then sees the drain. `ft lab up` puts the device back, and the health check resumes
    the node it drained."""
    found = find_rank(run_dir, rank)
    devices = sorted((state_dir() / "dev" / found.node).glob("nvidia[0-9]*"))
    if not devices:
        raise FtError(f"{found.node} has no GPU device left to fail", hint="`ft lab up` puts them back")
    devices[-1].unlink()
    return found, devices[-1]


def gpu_xid(run_dir: Path, rank: int, code: int = 94) -> RankProcess:
    """An XID in the kernel log of the node a rank runs on, as the node's health check reads it: the
    lab has no GPU, so its checks read the GPU tools' outputs from files (FT_HC_RECORDED), written
    here in the tools' formats for a node of healthy GPUs plus this one line. What follows is the
    action table's (toolkit/health/actions.py): XID 94 (a contained ECC error: the context is lost,
    the GPU sound) drains the node for a restart, resets it once the run has moved off and resumes
    it; XID 79 (off the bus) drains it for an admin."""
    found = find_rank(run_dir, rank)
    manifest = LabManifest.load()
    gpus = manifest.gpus_per_node if manifest else 4
    recorded = state_dir() / "dev" / found.node / "recorded"
    recorded.mkdir(parents=True, exist_ok=True)
    buses = [f"00000000:{0x18 + 0x10 * index:02X}:00.0" for index in range(gpus)]
    (recorded / "nvidia-smi-L.txt").write_text("".join(
        f"GPU {index}: NVIDIA H100 80GB HBM3 (UUID: GPU-lab-{found.node}-{index})\n" for index in range(gpus)))
    (recorded / "nvidia-smi-query.csv").write_text("".join(
        f"{index}, {bus}, 0, No, No, No\n" for index, bus in enumerate(buses)))
    (recorded / "nvidia-smi-nvlink.txt").write_text("")
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    with open(recorded / "dmesg.txt", "a") as log:
        log.write(f"[{uptime:12.6f}] NVRM: Xid (PCI:{buses[-1][4:14]}): {code}, pid={found.pid}, name=python, "
                  "Contained: CE User Channel (0x1). RST: No, D-RST: No\n")
    return found


FILL_LIMIT_BYTES = 4 << 30  # the largest filesystem ft chaos fills: one made for it, never the lab's own disk
BALLOON = ".ft-chaos-disk-full"


def checkpoint_folder(run_dir: Path) -> Path:
    """Where the run's checkpoints are staged: the recipe's checkpoint.staging, else the run's own."""
    layout = RunLayout(run_dir)
    return Path(layout.read_spec().recipe.checkpoint.staging or layout.checkpoints)


def mount_type(path: Path) -> str:
    """The filesystem type of the mount holding `path` (the longest mount point above it)."""
    best, kind = "", ""
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        before, _, after = line.partition(" - ")
        point = before.split()[4].replace("\\040", " ")
        if (str(path) == point or str(path).startswith(point.rstrip("/") + "/")) and len(point) > len(best):
            best, kind = point, after.split()[0]
    return kind


@contextlib.contextmanager
def checkpoint_disk_full(run_dir: Path) -> Iterator[Path]:
    """The filesystem the run's checkpoints are written to, full (ENOSPC from the kernel) while the
    context lasts; freed when it ends. Only a small tmpfs (made for it and named in the recipe's
    checkpoint.staging): filling the lab's own disk would fill this machine's. The folder is opened
    once, without following links, and the balloon made inside it the same way: a link planted in
    the run's folder cannot point the filling anywhere else."""
    require_root("ft chaos", CHAOS_NEEDS_ROOT)
    folder = Path(os.path.realpath(checkpoint_folder(run_dir)))
    refuse = FtError(f"the run's checkpoints are not on a small tmpfs made for it ({folder}): ft chaos fills "
                     "only one made for it",
                     hint="mount a small one (mount -t tmpfs -o size=64m tmpfs DIR) and name it in the "
                          "recipe's checkpoint.staging")
    try:
        directory = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        raise refuse from None
    balloon = None
    try:
        info = os.fstatvfs(directory)
        if info.f_blocks * info.f_frsize > FILL_LIMIT_BYTES or os.fstat(directory).st_dev == os.stat("/").st_dev \
                or mount_type(folder) != "tmpfs":
            raise refuse
        try:
            balloon = os.open(BALLOON, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=directory)
        except FileExistsError:
            raise FtError(f"{folder / BALLOON} is there already (another `ft chaos disk-full`, or something put "
                          "in its place): not filling", hint="remove it once no ft chaos runs") from None
        with contextlib.suppress(OSError):  # without fallocate, the writes below fill it
            os.posix_fallocate(balloon, 0, info.f_bavail * info.f_frsize)
        chunk = b"\0" * (64 << 10)
        with contextlib.suppress(OSError):  # ENOSPC: full
            while True:
                os.write(balloon, chunk)
        yield folder
    finally:
        if balloon is not None:
            os.close(balloon)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(BALLOON, dir_fd=directory)
        os.close(directory)
