"""`ft chaos disk-full` fills only a filesystem made for it: never this machine's own disk (the lab
test in tests/lab/test_recovery.py fills a tmpfs for real)."""

from __future__ import annotations

import os
import subprocess

import pytest

from tests.support.run_specs import run_spec, write_run_spec
from toolkit.base.errors import FtError
from toolkit.lab import chaos


@pytest.mark.skipif(os.geteuid() != 0, reason="ft chaos asks for root first")
def test_the_lab_hosts_own_disk_is_never_filled(tmp_path):
    spec = run_spec()
    spec.recipe.checkpoint.staging = str(tmp_path)  # on this machine's root filesystem
    write_run_spec(tmp_path, spec)
    with pytest.raises(FtError, match="fills only one made for it") as refused, \
            chaos.checkpoint_disk_full(tmp_path):
        pass
    assert "checkpoint.staging" in refused.value.hint
    assert not (tmp_path / chaos.BALLOON).exists()


@pytest.fixture
def small_tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounts a tmpfs")
    mount = tmp_path / "staging"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def run_on(tmp_path, staging) -> None:
    spec = run_spec()
    spec.recipe.checkpoint.staging = str(staging)
    write_run_spec(tmp_path, spec)


def test_a_small_tmpfs_is_filled_while_it_lasts_and_given_back(tmp_path, small_tmpfs):
    run_on(tmp_path, small_tmpfs)
    with chaos.checkpoint_disk_full(tmp_path), pytest.raises(OSError, match="No space left"):
        (small_tmpfs / "a-save").write_bytes(b"x" * 8192)
    assert not (small_tmpfs / chaos.BALLOON).exists()
    assert os.statvfs(small_tmpfs).f_bavail > 0


def test_a_link_planted_as_the_balloon_is_never_followed(tmp_path, small_tmpfs):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (small_tmpfs / chaos.BALLOON).symlink_to(victim)
    run_on(tmp_path, small_tmpfs)
    with pytest.raises(FtError, match="is there already"), chaos.checkpoint_disk_full(tmp_path):
        pass
    assert victim.read_text() == "precious"
