"""Node health checks over the GPU tools' outputs (recorded/: written in the real tools' formats,
no GPU here) and over this machine's real filesystem and memory."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from toolkit.health import host
from toolkit.health.__main__ import main, run_checks
from toolkit.health.actions import worst

RECORDED = Path(__file__).parent / "recorded"


def test_a_healthy_node_only_warns_about_an_applications_xid(capsys):
    findings = run_checks(2, [], RECORDED / "healthy")
    assert [(f.check, f.action) for f in findings] == [("gpu_xid", "warn")]
    assert main(["--gpus", "2", "--recorded", str(RECORDED / "healthy")]) == 0
    assert "warn: gpu_xid: XID 13 on 0000:18:00" in capsys.readouterr().out


def test_a_gpu_off_the_bus_drains_the_node_once_per_gpu_and_code(capsys):
    findings = run_checks(2, [], RECORDED / "xid79")
    assert {(f.check, f.action) for f in findings} == {("gpu_count", "drain"), ("gpu_xid", "drain")}
    assert sum(f.check == "gpu_xid" for f in findings) == 1  # three log lines, one GPU and code
    assert main(["--gpus", "2", "--recorded", str(RECORDED / "xid79")]) == 1
    assert "1 of 2 GPUs visible" in capsys.readouterr().out


def test_uncorrectable_ecc_and_a_pending_remap_drain_and_a_contained_error_restarts():
    findings = run_checks(2, [], RECORDED / "ecc")
    actions = {(f.check, f.action) for f in findings}
    assert {("gpu_ecc", "drain"), ("gpu_pending_reset", "drain")} <= actions
    assert ("gpu_xid", "restart") in actions and ("gpu_xid", "warn") in actions  # XID 94, XID 63
    assert worst(findings) == "drain"


def test_no_gpu_tools_no_gpu_findings(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 1000 kB\nMemAvailable: 900 kB\n")
    assert run_checks(4, [], tmp_path) == []


def test_a_checkpoint_filesystem_that_does_not_answer_drains_within_the_timeout(tmp_path):
    assert host.filesystem_findings(str(tmp_path)) == []  # this machine's disk: answers, free enough
    began = time.monotonic()
    # A stat on a hung Lustre mount blocks in the kernel; a probe that blocks for 30 s stands in.
    (finding,) = host.filesystem_findings(str(tmp_path), timeout=1, probe=lambda path: time.sleep(30))
    assert finding.action == "drain" and "did not answer a stat within 1 s" in finding.detail
    assert time.monotonic() - began < 5


def test_a_full_filesystem_and_scarce_memory_are_found():
    assert host.memory_findings("MemTotal: 1000000 kB\nMemAvailable: 10000 kB\n")[0].action == "warn"
    assert host.memory_findings("MemTotal: 1000000 kB\nMemAvailable: 900000 kB\n") == []


def test_the_command_runs_on_this_node_without_torch():
    result = subprocess.run([sys.executable, "-c", "import sys, runpy; sys.argv = ['x', '--path', '/tmp']; "
                             "import toolkit.health.__main__ as m; code = m.main(sys.argv[1:]); "
                             "assert 'torch' not in sys.modules; sys.exit(code)"],
                            capture_output=True, text=True,
                            env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2])))
    assert result.returncode == 0, result.stdout + result.stderr


HOOK = Path(__file__).parents[2] / "ansible" / "roles" / "slurm" / "files" / "healthcheck.d" / "20-ft-health"


def run_hook(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(HOOK)], capture_output=True, text=True, timeout=60,
                          env={"PATH": os.environ["PATH"], "PYTHONPATH": str(Path(__file__).parents[2]), **env})


def test_the_health_check_hook_drains_with_the_finding_as_the_reason():
    """What Slurm's HealthCheckProgram (ft-healthcheck) runs: exit 1 and one line, its drain reason."""
    drained = run_hook(FT_HC_PYTHON=sys.executable, FT_HC_GPUS_PER_NODE="2", FT_HC_RECORDED=str(RECORDED / "xid79"))
    assert drained.returncode == 1 and drained.stdout.startswith("drain: ") and drained.stdout.count("\n") == 1
    healthy = run_hook(FT_HC_PYTHON=sys.executable, FT_HC_GPUS_PER_NODE="2", FT_HC_RECORDED=str(RECORDED / "healthy"),
                       FT_HC_CHECKPOINT_PATHS="/tmp")
    assert healthy.returncode == 0 and healthy.stdout == ""
    assert run_hook().returncode == 0  # no Python configured: skipped
