"""The shared filesystem's tier: a write killed half-way never becomes a checkpoint; a corrupt or
truncated newest checkpoint is caught by its manifest and the one before it used; a manifest from
elsewhere never names a path outside its folder."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from toolkit.checkpoint import manifest
from toolkit.checkpoint.manifest import FileEntry, Manifest, tag_for
from toolkit.checkpoint.shared import SharedTier

LINEAGE = "0123456789abcdef"


def write_checkpoint(tier: SharedTier, step: int, payload: bytes = b"weights" * 1000, lineage: str = LINEAGE) -> None:
    tier.prepare()
    staged = tier.staged(tag_for(step))
    (staged / "zero").mkdir(parents=True)
    (staged / "model.pt").write_bytes(payload + str(step).encode())
    (staged / "zero" / "optim.pt").write_bytes(payload[::-1])
    tier.publish(manifest.describe(staged, step, lineage))


def test_publish_moves_the_pointer_and_keeps_the_last_k(tmp_path):
    tier = SharedTier(tmp_path, keep_last=2)
    for step in (10, 20, 30):
        write_checkpoint(tier, step)
    assert tier.latest_pointer() == "step-00000030"
    assert tier.tags() == ["step-00000030", "step-00000020"]
    assert manifest.verify(tmp_path / "step-00000030", LINEAGE) is None
    assert set(manifest.read(tmp_path / "step-00000030").files) == {"model.pt", "zero/optim.pt"}


def test_a_save_killed_mid_write_never_becomes_a_checkpoint(tmp_path):
    tier = SharedTier(tmp_path, keep_last=3)
    write_checkpoint(tier, 10)
    # A real process dies (SIGKILL) while writing the next checkpoint's files.
    killed = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from toolkit.checkpoint.shared import SharedTier
        tier = SharedTier(Path({str(tmp_path)!r}), keep_last=3)
        tier.prepare()
        staged = tier.staged("step-00000020")
        staged.mkdir(parents=True)
        with open(staged / "model.pt", "wb") as handle:
            handle.write(b"half a checkpoint")
            handle.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    """)])
    assert killed.returncode == -9
    assert tier.latest_pointer() == "step-00000010"
    assert tier.newest_whole(LINEAGE, print) == "step-00000010"
    write_checkpoint(tier, 20)  # the next save clears the leftovers and succeeds
    assert tier.newest_whole(LINEAGE, print) == "step-00000020"


def test_truncated_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    tier = SharedTier(tmp_path, keep_last=3)
    write_checkpoint(tier, 10)
    write_checkpoint(tier, 20)
    newest = tmp_path / "step-00000020" / "model.pt"
    newest.write_bytes(newest.read_bytes()[:100])  # truncated, e.g. by a full filesystem
    warnings: list[str] = []

    assert tier.newest_whole(LINEAGE, warnings.append) == "step-00000010"
    assert len(warnings) == 1 and "step-00000020" in warnings[0] and "model.pt" in warnings[0]


def test_flipped_byte_is_caught_by_the_checksum(tmp_path):
    tier = SharedTier(tmp_path, keep_last=3)
    write_checkpoint(tier, 10)
    path = tmp_path / "step-00000010" / "zero" / "optim.pt"
    data = bytearray(path.read_bytes())
    data[7] ^= 0xFF
    path.write_bytes(bytes(data))
    assert "sha256" in manifest.verify(tmp_path / "step-00000010")
    assert tier.newest_whole(LINEAGE, lambda _: None) is None


def test_a_checkpoint_of_another_model_or_method_is_never_resumed(tmp_path):
    tier = SharedTier(tmp_path, keep_last=3)
    write_checkpoint(tier, 10)
    write_checkpoint(tier, 20, lineage="fedcba9876543210")  # the recipe changed its model, kept its folder
    warnings: list[str] = []
    assert tier.newest_whole(LINEAGE, warnings.append) == "step-00000010"
    assert "another model or method" in warnings[0]


def test_publish_takes_the_ranks_marks_and_refuses_a_part_of_the_wrong_size(tmp_path):
    tier = SharedTier(tmp_path, keep_last=3)
    tier.prepare()
    staged = tier.staged(tag_for(5))
    staged.mkdir(parents=True)
    (staged / "rank0.pt").write_bytes(b"a" * 10)
    (staged / "rank1.pt").write_bytes(b"b" * 10)
    tier.mark_written(tag_for(5), 0, {"rank0.pt": FileEntry(10, "0" * 64)})
    tier.mark_written(tag_for(5), 1, {}, failure="OSError: No space left on device")
    marks = tier.written_marks(tag_for(5))
    assert marks[0].files == {"rank0.pt": FileEntry(10, "0" * 64)} and marks[0].failure == ""
    assert "No space" in marks[1].failure
    with pytest.raises(OSError, match="rank1.pt is 10 bytes, its writer wrote 11"):
        tier.publish(Manifest(5, {"rank1.pt": FileEntry(11, "1" * 64)}, LINEAGE))
    assert tier.tags() == []


@pytest.mark.parametrize("name", ["../outside", "/etc/passwd", "a/../../b", "a//b", ".hidden", ""])
def test_a_manifest_naming_a_path_outside_its_folder_is_refused(name):
    text = Manifest(1, {"ok.pt": FileEntry(1, "a" * 64)}).to_json().replace('"ok.pt"', f'"{name}"')
    with pytest.raises(ValueError, match="unsafe path"):
        Manifest.from_json(text)


@pytest.mark.parametrize("text", ['[]', '{"step": "1", "files": {}}', '{"step": 1}',
                                  '{"step": 1, "files": {"a": {"bytes": -1, "sha256": "' + "a" * 64 + '"}}}',
                                  '{"step": 1, "files": {"a": {"bytes": 1, "sha256": "xyz"}}}'])
def test_a_malformed_manifest_is_refused(text):
    with pytest.raises(ValueError):
        Manifest.from_json(text)


def test_a_checkpoint_brought_back_replaces_the_newer_unusable_ones_and_is_kept(tmp_path):
    tier = SharedTier(tmp_path / "shared", keep_last=2)
    for step in (10, 20):
        write_checkpoint(tier, step)
    for tag in ("step-00000010", "step-00000020"):  # both damaged (a lost storage target)
        (tier.root / tag / "model.pt").write_bytes(b"gone")
    assert tier.newest_whole(LINEAGE, lambda _: None) is None
    other = SharedTier(tmp_path / "elsewhere", keep_last=2)  # stands in for the copy from S3
    write_checkpoint(other, 5)
    landing = tier.staging / "restore-step-00000005"
    landing.parent.mkdir(parents=True, exist_ok=True)
    (other.root / "step-00000005").rename(landing)
    tier.adopt(landing, "step-00000005")
    assert tier.tags() == ["step-00000005"]  # kept, and the damaged newer ones gone
    assert tier.newest_whole(LINEAGE, print) == "step-00000005"


def test_a_checkpoint_being_uploaded_is_not_pruned_under_it(tmp_path):
    tier = SharedTier(tmp_path, keep_last=1)
    write_checkpoint(tier, 10)
    tier.pinned.add("step-00000010")
    write_checkpoint(tier, 20)
    assert tier.tags() == ["step-00000020", "step-00000010"]
    tier.pinned.clear()
    tier.prune()
    assert tier.tags() == ["step-00000020"]


def test_a_manifest_of_another_step_or_of_nothing_is_not_whole(tmp_path):
    tier = SharedTier(tmp_path, keep_last=3)
    write_checkpoint(tier, 10)
    (tmp_path / "step-00000010").rename(tmp_path / "step-00000030")  # a folder renamed by hand
    assert "of step 10" in manifest.verify(tmp_path / "step-00000030", LINEAGE, 30)
    for text in ('{"step": 1, "files": {}}', '{"step": -1, "files": {"a": {"bytes": 1, "sha256": "' + "a" * 64 + '"}}}',
                 "[" * 100_000 + "]" * 100_000):
        with pytest.raises(ValueError):
            Manifest.from_json(text)
