"""Static checks that belong to the test suite: ansible-lint (production profile) and shellcheck."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHELL_SCRIPTS = [
    ".ci/run",
    "ansible/roles/slurm/files/ft-healthcheck",
    *sorted(str(p.relative_to(REPO)) for p in (REPO / "ansible/roles/slurm/files/healthcheck.d").iterdir()),
    *sorted(str(p.relative_to(REPO)) for p in REPO.glob("scripts/*.sh")),
    *sorted(str(p.relative_to(REPO)) for p in REPO.glob("benchmarks/*.sh")),
]


def test_ansible_lint_production_profile_passes():
    lint = Path(sys.executable).with_name("ansible-lint")
    result = subprocess.run([str(lint), "--nocolor", "--profile", "production"], cwd=REPO / "ansible",
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "Profile 'production' was required, and it passed" in result.stderr + result.stdout


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (apt install shellcheck)")
@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_scripts_are_shellcheck_clean(script):
    result = subprocess.run(["shellcheck", "--external-sources", str(REPO / script)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout
