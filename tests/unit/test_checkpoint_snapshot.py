"""Asynchronous checkpoints with real DeepSpeed (two gloo ranks, ZeRO-1, so each rank writes a part):
training waits only for the snapshot, steps taken while the write goes on do not leak into it, a
resumed run repeats the uninterrupted one exactly, and a failed write loses that checkpoint only."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from toolkit.checkpoint import manifest

torch = pytest.importorskip("torch", reason="the training stack (ft[train]) is not installed")

# argv: checkpoint root, model folder, first step, last step, save steps (comma separated), the step
# whose save fails on rank 1 (0: none). The filesystem is slow (0.4 s a file), so that the steps
# after a save run while it is written; the copy of the state is late (0.3 s), so that the next step's
# optimizer would change the state under it if it did not wait.
RANK_SCRIPT = textwrap.dedent("""
    import hashlib, json, sys, time
    from pathlib import Path
    import deepspeed, torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from toolkit.train import snapshot
    from toolkit.train.checkpoint import Checkpointer, Tiers
    from toolkit.checkpoint.shared import SharedTier
    from toolkit.checkpoint.status import StatusBoard

    root, model_dir = Path(sys.argv[1]), sys.argv[2]
    first, last, fail_at = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[6])
    saves = {int(s) for s in sys.argv[5].split(",")}
    deepspeed.init_distributed("gloo")
    rank = dist.get_rank()
    real_write = snapshot.BackgroundWriter._write_file
    def slow_write(self, path, state):
        time.sleep(0.4)
        if rank == 1 and f"step-{fail_at:08d}" in str(path):
            raise OSError(28, "No space left on device")
        return real_write(self, path, state)
    snapshot.BackgroundWriter._write_file = slow_write
    real_copies = snapshot.SaveJob.take_copies
    def slow_copies(self):  # the copy is late: the next optimizer step must wait for it
        time.sleep(0.3)
        real_copies(self)
    snapshot.SaveJob.take_copies = slow_copies

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": 1}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())

    class Progress:
        def report(self, *args):
            pass

    logged = []
    def log(message):
        logged.append(message)
        print(f"[rank {rank}] {message}", flush=True)

    board = StatusBoard(root.parent / "checkpoints.json" if rank == 0 else None, None)
    saver = Checkpointer(Tiers(SharedTier(root, 3), None), engine, dist, rank, 2, Progress(), log,
                         frozen_excluded=False, lineage="test-lineage", asynchronous=True, board=board)

    def digest():
        flat = torch.cat([p.detach().flatten() for p in engine.module.parameters()])
        return hashlib.sha256(flat.numpy().tobytes()).hexdigest()

    start = saver.resume()
    assert start == first - 1, (start, first)
    digests, stalls = {}, {}
    for step in range(first, last + 1):
        batch = torch.full((1, 8), 3 + step + rank, dtype=torch.long)
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        saver.before_optimizer_step()
        engine.step()
        digests[step] = digest()
        if step in saves:
            began = time.monotonic()
            saver.save(step)
            stalls[step] = time.monotonic() - began
    saver.close(upload_wait=5)
    if rank == 0:
        print("RESULT " + json.dumps({"digests": digests, "stalls": stalls, "paused": saver.stalls, "logged": logged,
                                      "write_seconds": saver.writer.write_seconds}), flush=True)
""")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ranks(*args: str) -> dict:
    port = free_port()
    env = {"PATH": "/usr/bin:/bin", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, *map(str, args)], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}) for rank in (0, 1)]
    outputs = [rank.communicate(timeout=300)[0] for rank in ranks]
    for process, output in zip(ranks, outputs, strict=True):
        assert process.returncode == 0, output[-4000:]
    line = next(line for line in outputs[0].splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from toolkit.train.tiny import build_model

    path = tmp_path_factory.mktemp("tiny")
    build_model(path, vocab_size=64, hidden=64, layers=2)
    return path


def test_async_saves_resume_to_the_uninterrupted_run_and_a_failed_write_loses_only_itself(tmp_path, tiny_model):
    root = tmp_path / "checkpoints"
    # Saves at 2 and 4 (steps 3-4 run while step 2 is written); rank 1's write of step 6 fails.
    trained = run_ranks(root, tiny_model, 1, 7, "2,4,6", 6)
    write_s = 2 * 0.4  # each rank writes two files a save (the module's states, its ZeRO shard), 0.4 s each
    assert trained["stalls"]["2"] < write_s / 2, trained["stalls"]  # training waited for the snapshot only
    assert trained["paused"][0] >= 0.25  # the late copy: step 3's optimizer waited for it
    assert any("abandoned" in line and "rank 1" in line and "No space" in line for line in trained["logged"])
    tiers = sorted(p.name for p in root.iterdir() if manifest.is_tag(p.name))
    assert tiers == ["step-00000002", "step-00000004"]  # step 6 was lost, and only step 6
    files = manifest.read(root / "step-00000004").files
    assert len([name for name in files if "zero_pp_rank_1" in name]) == 1, files  # rank 1's part is in it
    assert manifest.verify(root / "step-00000004", "test-lineage") is None
    status = json.loads((tmp_path / "checkpoints.json").read_text())
    assert status["shared"]["step"] == 4

    # The newest checkpoint gone: the run resumes from step 2 and repeats steps 3-4 exactly, which
    # it could not if the snapshot of step 2 had taken in anything of steps 3-4.
    shutil.rmtree(root / "step-00000004")
    resumed = run_ranks(root, tiny_model, 3, 4, "4", 0)
    assert resumed["digests"]["3"] == trained["digests"]["3"]
    assert resumed["digests"]["4"] == trained["digests"]["4"]
    assert any("resumed from checkpoint step-00000002" in line for line in resumed["logged"])


def test_host_buffers_copy_the_state_and_serve_the_next_save():
    from collections import OrderedDict

    from toolkit.train.snapshot import HostBuffers

    weight = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
    moment = torch.ones(3)
    state = {"module": OrderedDict(w=weight), "optimizer": {"state": [moment, moment], "step": 7},
             "shapes": {"w": torch.Size([2, 3])}}
    buffers = HostBuffers()
    buffers.begin()
    first = buffers.copy(state, {})
    buffers.end()
    with torch.no_grad():
        weight.add_(100)
        moment.mul_(5)
    assert torch.equal(first["module"]["w"], torch.arange(6.0).reshape(2, 3))  # a copy, not a view
    assert isinstance(first["module"], OrderedDict) and isinstance(first["module"]["w"], torch.nn.Parameter)
    assert first["optimizer"]["state"][0] is first["optimizer"]["state"][1]  # shared stays shared
    assert first["optimizer"]["step"] == 7 and first["shapes"]["w"] == torch.Size([2, 3])
    buffers.begin()
    second = buffers.copy(state, {})
    assert second["optimizer"]["state"][0].data_ptr() == first["optimizer"]["state"][0].data_ptr()  # reused
    assert torch.equal(second["optimizer"]["state"][0], torch.full((3,), 5.0))


class Payload:
    """What a planted checkpoint would carry: unpickling it runs a command."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_that_would_run_code_is_refused_as_it_loads(tmp_path):
    from toolkit.train.snapshot import SnapshotEngine

    marker = tmp_path / "ran"
    planted = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "extra": Payload(str(marker))}, planted)
    engine = SnapshotEngine.__new__(SnapshotEngine)  # load needs none of the writer's state
    with pytest.raises(Exception, match="Weights only load failed"):
        engine.load(str(planted))
    assert not marker.exists()
    honest = tmp_path / "honest.pt"
    torch.save({"module": {"w": torch.ones(2)}, "step": 3}, honest)
    assert engine.load(str(honest))["step"] == 3


def test_a_writer_whose_mark_cannot_be_written_lives_on_and_the_next_save_does_not_hang(tmp_path):
    from toolkit.checkpoint.shared import SharedTier
    from toolkit.train.snapshot import BackgroundWriter, SaveJob

    class MarkFails(SharedTier):
        def mark_written(self, *args, **kwargs):
            raise OSError(122, "Disk quota exceeded")

    logged: list[str] = []
    writer = BackgroundWriter(MarkFails(tmp_path, 2), rank=1, world=2, lineage="l", zipfile=True,
                              on_published=lambda m: None, log=logged.append)
    for step in (1, 2):
        job = SaveJob(f"step-{step:08d}", [(tmp_path / ".staging" / f"step-{step:08d}" / "x.pt", {"w": torch.ones(2)})])
        writer.submit(job)
        assert writer.wait_marked() < 5 and writer.wait() < 5
    assert writer.thread.is_alive() and sum("quota" in line for line in logged) == 2
    writer.close()


@pytest.mark.parametrize("breaks", ["mark", "publish", "after publishing"])
def test_a_writer_lives_on_whatever_its_filesystem_or_its_listener_raises(tmp_path, breaks):
    """snapshot.py's blind excepts: the mark, the publish and the hand-over after it may raise what a
    filesystem or the status board raises (here a RuntimeError, as torch's writer raises on a full
    disk): that save is lost or unannounced, the thread lives, the next save does not hang."""
    from toolkit.checkpoint.shared import SharedTier
    from toolkit.train.snapshot import BackgroundWriter, SaveJob

    class Breaks(SharedTier):
        def mark_written(self, *args, **kwargs):
            if breaks == "mark":
                raise RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")
            return super().mark_written(*args, **kwargs)

        def publish(self, *args, **kwargs):
            if breaks == "publish":
                raise RuntimeError("the shared filesystem said something new")
            return super().publish(*args, **kwargs)

    def on_published(published):
        if breaks == "after publishing":
            raise RuntimeError("the status board broke")

    logged: list[str] = []
    shared = Breaks(tmp_path, 2)
    writer = BackgroundWriter(shared, rank=0, world=1, lineage="l", zipfile=True, on_published=on_published,
                              log=logged.append)
    for step in (1, 2):
        tag = f"step-{step:08d}"
        writer.submit(SaveJob(tag, [(tmp_path / ".staging" / tag / "x.pt", {"w": torch.ones(2)})]))
        assert writer.wait_marked() < 5 and writer.wait() < 5
    assert writer.thread.is_alive() and sum("RuntimeError" in line for line in logged) == 2, logged
    writer.close()

def test_a_part_whose_write_fails_unforeseen_loses_only_its_save(tmp_path, monkeypatch):
    """snapshot.py's blind except in _write: a part's write raising what nobody foresaw (not a full
    disk's OSError, nor torch's RuntimeError) is marked as this rank's failure, so the save is
    abandoned at once, naming it; the next save is written and published (narrowed to OSError, this
    test fails: checked; the thread's own guard would keep it alive, but no mark says why)."""
    from toolkit.checkpoint.shared import SharedTier
    from toolkit.train.snapshot import BackgroundWriter, SaveJob

    class Unforeseen(Exception):
        pass

    real_write = BackgroundWriter._write_file

    def write_file(self, path, state):
        if "step-00000001" in str(path):
            raise Unforeseen("the filesystem broke in a way nobody foresaw")
        return real_write(self, path, state)

    monkeypatch.setattr(BackgroundWriter, "_write_file", write_file)
    logged: list[str] = []
    shared = SharedTier(tmp_path, 2)
    writer = BackgroundWriter(shared, rank=0, world=1, lineage="l", zipfile=True, on_published=lambda m: None,
                              log=logged.append)
    for step in (1, 2):
        tag = f"step-{step:08d}"
        writer.submit(SaveJob(tag, [(tmp_path / ".staging" / tag / "x.pt", {"w": torch.ones(2)})]))
        assert writer.wait_marked() < 5 and writer.wait() < 5
    assert writer.thread.is_alive()
    assert any("checkpoint step-00000001 abandoned: rank 0: Unforeseen: the filesystem broke" in line
               for line in logged), logged
    assert shared.tags() == ["step-00000002"]
    writer.close()


class ByName:
    """Pickles as Debian 12's Python 3.11.2 pickles an enum member: getattr(cls, name)."""

    def __init__(self, kind, name):
        self.kind, self.name = kind, name

    def __reduce__(self):
        return getattr, (self.kind, self.name)


def test_an_enum_pickled_by_name_loads_and_nothing_else_through_getattr(tmp_path):
    import pickle

    from deepspeed.runtime.zero.config import ZeroStageEnum

    from toolkit.train.snapshot import checkpoint_classes

    def load(value):
        torch.save({"zero_stage": value}, tmp_path / "state.pt")
        with torch.serialization.safe_globals(checkpoint_classes()):
            return torch.load(tmp_path / "state.pt", weights_only=True)

    assert load(ByName(ZeroStageEnum, "optimizer_states"))["zero_stage"] is ZeroStageEnum.optimizer_states
    with pytest.raises(pickle.UnpicklingError, match="only ZeroStageEnum's members load"):
        load(ByName(ZeroStageEnum, "__class__"))
    with pytest.raises(pickle.UnpicklingError):
        load(ByName(ZeroStageEnum, "mro"))
