"""Saving without stopping training for the write: DeepSpeed's checkpoint engine, replaced.

DeepSpeed's save_checkpoint hands each state dict (the module's, each ZeRO shard's) to its checkpoint
engine. This one copies the tensors into host buffers (pinned for GPUs; kept from one save to the
next, so a save allocates nothing once warm) and returns: that copy is all training waits for. A
writer thread per rank then serializes the copies into the checkpoint's staging folder on the shared
filesystem, hashing as it writes, and leaves a mark listing its files; rank 0's writer publishes the
checkpoint once every rank's mark is there (toolkit/checkpoint/shared.py). The next save waits for
the previous write to finish, so no two saves ever overlap and the buffers are free again.
"""

from __future__ import annotations

import copy
import hashlib
import os
import pickle
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from toolkit.checkpoint.manifest import FileEntry, Manifest, step_of
from toolkit.checkpoint.shared import SharedTier

PUBLISH_WAIT_S = 1800.0  # rank 0 waits this long for the other ranks' marks before abandoning a save


def checkpoint_classes() -> list:
    """What DeepSpeed's checkpoints hold besides tensors and plain data (found by loading every kind
    it writes: LoRA and full, ZeRO 0-3, fp32 and bf16). A checkpoint is unpickled with these allowed
    and nothing else, so one from a shared folder or a bucket cannot run code as it loads.

    Some Python releases (Debian 12's 3.11.2 among them) pickle an enum member by name, as
    `getattr(ZeroStageEnum, "optimizer_states")`: builtins.getattr is allowed only as `enum_member`,
    which looks a name up among the members of these classes' enums and nothing else."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address, (enum_member, "builtins.getattr")]


def enum_member(kind, name: str):
    """getattr as an unpickled checkpoint may call it: a member of an allowed enum, by its name."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    if kind is not ZeroStageEnum or name not in ZeroStageEnum.__members__:
        raise pickle.UnpicklingError(f"a checkpoint asked for {kind!r}.{name}: only ZeroStageEnum's members load")
    return ZeroStageEnum[name]


class HostBuffers:
    """Copies of a state's tensors in host memory, one buffer per tensor in the order a save meets
    them; the same buffers serve the next save when the shapes agree."""

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.next = 0
        self.on_gpu = False

    def begin(self) -> None:
        self.next, self.on_gpu = 0, False

    def copy(self, value, memo: dict):
        if isinstance(value, torch.Tensor):
            if id(value) not in memo:
                memo[id(value)] = self._tensor(value)
            return memo[id(value)]
        if isinstance(value, dict):
            copied = copy.copy(value)  # dict, OrderedDict, defaultdict: the same kind
            for key, item in value.items():
                copied[key] = self.copy(item, memo)
            return copied
        if type(value) in (list, tuple):
            return type(value)(self.copy(item, memo) for item in value)
        return copy.deepcopy(value, memo)

    def _tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        index, self.next = self.next, self.next + 1
        source = tensor.detach()
        if index < len(self.buffers) and self.buffers[index].shape == source.shape and \
                self.buffers[index].dtype == source.dtype:
            buffer = self.buffers[index]
        else:
            buffer = torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=source.is_cuda)
            if index < len(self.buffers):
                self.buffers[index] = buffer
            else:
                self.buffers.append(buffer)
        buffer.copy_(source, non_blocking=source.is_cuda)
        self.on_gpu |= source.is_cuda
        if isinstance(tensor, torch.nn.Parameter):
            return torch.nn.Parameter(buffer, requires_grad=tensor.requires_grad)
        return buffer

    def end(self) -> None:
        if self.on_gpu:
            torch.cuda.synchronize()  # the non-blocking copies are in host memory from here on


class HashingFile:
    """A file torch.save writes through, hashing and counting every byte on the way."""

    def __init__(self, handle):
        self.handle, self.digest, self.size = handle, hashlib.sha256(), 0

    def write(self, data) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()


@dataclass
class SaveJob:
    tag: str
    files: list[tuple[Path, object]] = field(default_factory=list)  # the states, live until copied
    buffers: HostBuffers | None = None  # set: the writer takes the copies (into these) before writing
    copied: threading.Event = field(default_factory=threading.Event)
    marked: threading.Event = field(default_factory=threading.Event)  # this rank's part written (or failed)

    def take_copies(self) -> None:
        try:
            if self.buffers is not None:
                self.files = [(path, self.buffers.copy(state, {})) for path, state in self.files]
                self.buffers.end()
        except BaseException:
            self.files = []  # never a live state written while training changes it
            raise
        finally:
            self.copied.set()  # training goes on, whatever became of this save


class BackgroundWriter:
    """One rank's writer: the snapshots of a save to the shared filesystem, then its mark; on rank 0
    the publish. With `asynchronous` off the same work runs inside the save (a synchronous save)."""

    def __init__(self, shared: SharedTier, rank: int, world: int, lineage: str, zipfile: bool,
                 on_published: Callable[[Manifest], None], log: Callable[[str], None], asynchronous: bool = True,
                 before_file: Callable[[], None] = lambda: None):
        self.shared, self.rank, self.world, self.lineage, self.zipfile = shared, rank, world, lineage, zipfile
        self.on_published, self.log, self.asynchronous = on_published, log, asynchronous
        self.before_file = before_file  # a hook for injected faults (toolkit/train/faults.py)
        self.jobs: queue.Queue[SaveJob | None] = queue.Queue()
        self.closing = threading.Event()
        self.last: SaveJob | None = None
        # Set once every rank is past its own part of the save being published (a barrier): a mark
        # still missing then will never come, and rank 0 abandons that checkpoint at once.
        self.ranks_done = threading.Event()
        self.write_seconds, self.last_write_s = 0.0, 0.0
        self.thread = threading.Thread(target=self._run, name="ft-checkpoint-writer", daemon=True)
        # Every byte is hashed into the manifest (sha256) as it is written: the zip format's own CRC32
        # would be a second checksum, and it cost half of torch.save's time (benchmarks/CHECKPOINT.md).
        # Process-wide, and this process is a training rank: nothing else in it saves large files so.
        torch.serialization.set_crc32_options(False)
        if asynchronous:
            self.thread.start()

    def submit(self, job: SaveJob) -> None:
        self.last = job
        self.ranks_done.clear()
        if self.asynchronous:
            self.jobs.put(job)
        else:
            self._write(job)

    def wait(self) -> float:
        """Wait for the save being written (if any), published included on rank 0; the seconds waited."""
        started = time.monotonic()
        self.jobs.join()
        return time.monotonic() - started

    def wait_marked(self) -> float:
        """Wait until this rank's part of the last save is written (or failed); the seconds waited."""
        started = time.monotonic()
        if self.last is not None:
            self.last.marked.wait()
        return time.monotonic() - started

    def close(self, abandon_unpublished: bool = False) -> None:
        """Wait for the save being written, then stop the thread. `abandon_unpublished`: rank 0 does
        not wait for other ranks' parts (after a failure they may never come)."""
        if abandon_unpublished:
            self.closing.set()
        self.wait()
        self.closing.set()
        self.jobs.put(None)

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                self._write(job)
            except Exception as exc:  # noqa: BLE001 - never the end of the thread: the next save would wait forever
                self.log(f"warning: checkpoint {job.tag} was not written: {type(exc).__name__}: {exc}")
            finally:
                job.copied.set()
                job.marked.set()
                self.jobs.task_done()
        self.jobs.task_done()

    def _write(self, job: SaveJob) -> None:
        started = time.monotonic()
        staged = self.shared.staged(job.tag)
        written: dict[str, FileEntry] = {}
        failure = ""
        try:
            job.take_copies()
            for path, state in job.files:
                written[str(path.relative_to(staged))] = self._write_file(path, state)
        except Exception as exc:  # noqa: BLE001 - a full or failing filesystem: this save is lost, training goes on
            failure = f"{type(exc).__name__}: {exc}"
            self.log(f"warning: writing checkpoint {job.tag} failed: {failure}")
        job.files.clear()  # the snapshot's references go; the buffers stay for the next save
        try:
            self.shared.mark_written(job.tag, self.rank, written, failure)
        except OSError as exc:  # the mark itself could not be written: rank 0 gives up on this save
            self.log(f"warning: checkpoint {job.tag}: this rank's mark could not be written ({exc})")
        finally:
            job.marked.set()
        self.last_write_s = time.monotonic() - started
        self.write_seconds += self.last_write_s
        if self.rank == 0:
            self._publish(job.tag)

    def _write_file(self, path: Path, state) -> FileEntry:
        self.before_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as handle:
            hashing = HashingFile(handle)
            torch.save(state, hashing, _use_new_zipfile_serialization=self.zipfile)
            handle.flush()
            os.fsync(handle.fileno())
        return FileEntry(hashing.size, hashing.digest.hexdigest())

    def _publish(self, tag: str) -> None:
        deadline = time.monotonic() + PUBLISH_WAIT_S
        while len(marks := self.shared.written_marks(tag)) < self.world:
            if self.closing.is_set() or self.ranks_done.is_set() or time.monotonic() > deadline:
                self.log(f"warning: checkpoint {tag} abandoned: {self.world - len(marks)} rank(s) never wrote "
                         "their part")
                return
            time.sleep(0.05)
        failures = {rank: mark.failure for rank, mark in marks.items() if mark.failure}
        if failures:
            self.log(f"warning: checkpoint {tag} abandoned: " +
                     "; ".join(f"rank {rank}: {why}" for rank, why in sorted(failures.items())))
            return
        files = {name: entry for mark in marks.values() for name, entry in mark.files.items()}
        try:
            published = self.shared.publish(Manifest(step_of(tag), files, self.lineage))
        except Exception as exc:  # noqa: BLE001 - a failing filesystem, whatever its kind: the checkpoint is lost, the run goes on
            self.log(f"warning: publishing checkpoint {tag} failed: {type(exc).__name__}: {exc}")
            return
        try:
            self.on_published(published)
        except Exception as exc:  # noqa: BLE001 - the status board or the mirror's hand-over: the checkpoint stands
            self.log(f"warning: after publishing checkpoint {tag}: {type(exc).__name__}: {exc}")


class SnapshotEngine(CheckpointEngine):
    """What DeepSpeed saves through: a snapshot per state dict, written by the rank's writer.

    Where the state is on a GPU, the copy (to pinned host memory, at the device's bandwidth) is taken
    before the save returns. Where it is in host memory (CPU training), the copy is a memcpy as long
    as the write's own work, so the writer takes it while the next step's forward and backward run:
    they only read the state, and the next optimizer step, the first to change it, waits for the copy
    (`wait_copied`)."""

    def __init__(self, writer: BackgroundWriter, defer_copy: bool = False):
        super().__init__()
        self.name = "ft-snapshot"
        self.writer, self.defer_copy = writer, defer_copy
        self.buffers = HostBuffers()
        self.job: SaveJob | None = None
        self.last: SaveJob | None = None

    def create(self, info: CheckpointCommitInfo) -> None:
        self.job = SaveJob(str(info.tag), buffers=self.buffers if self.defer_copy else None)
        self.buffers.begin()

    def save(self, state_dict, path: str) -> None:
        self.job.files.append((Path(path), state_dict if self.defer_copy else self.buffers.copy(state_dict, {})))

    def load(self, path: str, map_location=None):
        with torch.serialization.safe_globals(checkpoint_classes()):
            return torch.load(path, map_location=map_location, weights_only=True)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        if not self.defer_copy:
            self.buffers.end()
        self.last, self.job = self.job, None
        self.writer.submit(self.last)
        return True

    def wait_copied(self) -> float:
        """Before anything changes the state: wait until the last save's copy is taken; seconds waited."""
        if self.last is None or self.last.copied.is_set():
            return 0.0
        started = time.monotonic()
        self.last.copied.wait()
        return time.monotonic() - started

    def preserves_storage_sharing(self) -> bool:
        return False  # the snapshot is a compact copy already: no need for DeepSpeed's clone first
