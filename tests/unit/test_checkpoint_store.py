"""Checkpoint publishing: a write killed half-way never becomes "latest"; a corrupt newest
checkpoint is detected by its manifest and the one before it used."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from toolkit.train.checkpoint import CheckpointStore, tag_for, verify


def write_checkpoint(store: CheckpointStore, step: int, payload: bytes = b"weights" * 1000) -> None:
    store.prepare()
    staged = store.staging / tag_for(step)
    staged.mkdir(parents=True)
    (staged / "model.pt").write_bytes(payload + str(step).encode())
    (staged / "optim.pt").write_bytes(payload[::-1])
    store.publish(step)


def test_publish_moves_the_pointer_and_keeps_the_last_k(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=2)
    for step in (10, 20, 30):
        write_checkpoint(store, step)
    assert store.latest_pointer() == "step-00000030"
    assert store.tags() == ["step-00000030", "step-00000020"]
    assert verify(tmp_path / "step-00000030") is None


def test_a_save_killed_mid_write_never_becomes_latest(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=3)
    write_checkpoint(store, 10)
    # A real process dies (SIGKILL) while writing the next checkpoint's files.
    killed = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from toolkit.train.checkpoint import CheckpointStore
        store = CheckpointStore(Path({str(tmp_path)!r}), keep_last=3)
        store.prepare()
        staged = store.staging / "step-00000020"
        staged.mkdir(parents=True)
        with open(staged / "model.pt", "wb") as handle:
            handle.write(b"half a checkpoint")
            handle.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    """)])
    assert killed.returncode == -9
    assert store.latest_pointer() == "step-00000010"
    assert store.choose(print) == "step-00000010"
    write_checkpoint(store, 20)  # the next save clears the leftovers and succeeds
    assert store.choose(print) == "step-00000020"


def test_truncated_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=3)
    write_checkpoint(store, 10)
    write_checkpoint(store, 20)
    newest = tmp_path / "step-00000020" / "model.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated, e.g. by a full filesystem
    warnings: list[str] = []

    assert store.choose(warnings.append) == "step-00000010"
    assert len(warnings) == 1 and "step-00000020" in warnings[0] and "model.pt" in warnings[0]


def test_flipped_byte_is_caught_by_the_checksum(tmp_path):
    store = CheckpointStore(tmp_path, keep_last=3)
    write_checkpoint(store, 10)
    path = tmp_path / "step-00000010" / "optim.pt"
    data = bytearray(path.read_bytes())
    data[7] ^= 0xFF
    path.write_bytes(bytes(data))
    assert "sha256" in verify(tmp_path / "step-00000010")
    assert store.choose(lambda _: None) is None
