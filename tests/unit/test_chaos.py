"""`ft chaos disk-full` fills only a filesystem made for it: never this machine's own disk (the lab
test in tests/lab/test_recovery.py fills a tmpfs for real)."""

from __future__ import annotations

import os

import pytest

from tests.support.run_specs import run_spec, write_run_spec
from toolkit.errors import FtError
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
