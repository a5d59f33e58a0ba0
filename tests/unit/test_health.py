"""Node health checks over the GPU tools' outputs (recorded/: written in the real tools' formats,
no GPU here) and over this machine's real filesystem and memory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


def test_a_kernel_log_with_bytes_of_any_encoding_still_drains_for_its_xid(tmp_path):
    recorded = tmp_path / "recorded"
    shutil.copytree(RECORDED / "xid79", recorded)
    with open(recorded / "dmesg.txt", "ab") as log:
        log.write(b"[ 9.5] usb 1-1: Product: \xff\xfe caf\xe9\n")  # not UTF-8
    assert ("drain", "gpu_xid") in {(f.action, f.check) for f in run_checks(2, [], recorded)}
    drained = run_hook(FT_HC_PYTHON=sys.executable, FT_HC_GPUS_PER_NODE="2", FT_HC_RECORDED=str(recorded))
    assert drained.returncode == 1 and drained.stdout.startswith("drain: ")


def test_a_check_that_fails_is_a_warning_and_the_others_still_run(monkeypatch):
    from toolkit.health import __main__ as checks

    monkeypatch.setattr(checks.gpu, "nvlink_findings", lambda text: 1 / 0)
    findings = checks.run_checks(2, [], RECORDED / "xid79")
    assert {(f.action, f.check) for f in findings} >= {("warn", "gpu_nvlink_check_failed"), ("drain", "gpu_xid")}


def test_the_checks_failing_to_run_drain_no_node(tmp_path):
    """A Python error in the checks (here: a toolkit.health that raises) exits 1 like a drain, but
    with no finding: logged, and the node left in service, else every node would drain at once."""
    broken = tmp_path / "lib" / "toolkit" / "health"
    broken.mkdir(parents=True)
    (broken.parent / "__init__.py").write_text("")
    (broken / "__init__.py").write_text("")
    (broken / "__main__.py").write_text("raise RuntimeError('a bug in the checks')\n")
    crashed = run_hook(FT_HC_PYTHON=sys.executable, FT_HC_LIB=str(tmp_path / "lib"))
    assert crashed.returncode == 0 and crashed.stdout == ""


HEALTHCHECK = Path(__file__).parents[2] / "ansible" / "roles" / "slurm" / "files" / "ft-healthcheck"


def run_healthcheck(tmp_path: Path, hook_status: int, node_info: str = "NodeName=node3 State=IDLE Reason=(null)",
                    **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """ft-healthcheck with one hook and a scontrol that records what it was asked (no Slurm here:
    tests/lab/test_healthcheck.py runs it as the lab's real HealthCheckProgram and Prolog)."""
    hooks, bin_dir = tmp_path / "hooks", tmp_path / "bin"
    hooks.mkdir(exist_ok=True)
    bin_dir.mkdir(exist_ok=True)
    (hooks / "10-gpu").write_text(f"#!/bin/bash\necho 'found 3 of 4 GPU devices'\nexit {hook_status}\n")
    # show node: $NODE_INFO, and $NODE_INFO_AFTER (when given) from the second time on.
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho "$*" >> "$CALLS"\n'
                                      'if [ "$1 $2" = "show node" ]; then\n'
                                      '  if [ -e "$CALLS.shown" ]; then echo "${NODE_INFO_AFTER:-$NODE_INFO}"; '
                                      'else touch "$CALLS.shown"; echo "$NODE_INFO"; fi\nfi\nexit 0\n')
    (bin_dir / "logger").write_text("#!/bin/bash\n")
    for tool in (hooks / "10-gpu", bin_dir / "scontrol", bin_dir / "logger"):
        tool.chmod(0o755)
    calls = tmp_path / "calls"
    calls.unlink(missing_ok=True)
    (tmp_path / "calls.shown").unlink(missing_ok=True)
    result = subprocess.run([str(HEALTHCHECK)], capture_output=True, text=True, timeout=60,
                            env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls),
                                 "FT_HEALTHCHECK_DIR": str(hooks), "FT_HEALTHCHECK_ENV": "/nonexistent",
                                 "NODE_INFO": node_info, "FT_HC_STATE_DIR": str(tmp_path / "state"), **env})
    return result, calls.read_text().splitlines() if calls.exists() else []


def test_the_prolog_gate_drains_the_node_naming_the_job_and_fails_the_prolog(tmp_path):
    gate = {"SLURM_SCRIPT_CONTEXT": "prolog_slurmd", "SLURM_JOB_ID": "42", "SLURMD_NODENAME": "node3"}
    failed, calls = run_healthcheck(tmp_path, 1, **gate)
    assert failed.returncode == 1  # Slurm requeues the job onto other nodes
    assert calls == ["update nodename=node3 state=drain reason=ft-healthcheck: 10-gpu: found 3 of 4 GPU devices "
                     "(before job 42)"]
    passed, calls = run_healthcheck(tmp_path, 0, **gate)
    assert passed.returncode == 0 and calls == []  # nothing asked of Slurm before every job


def test_the_periodic_check_resumes_only_its_own_drain(tmp_path):
    passed, calls = run_healthcheck(tmp_path, 0, FT_HEALTHCHECK_NODE="node3")
    assert passed.returncode == 0 and calls == ["show node node3 -o"] * 2  # nothing drained: nothing resumed


def test_a_restart_finding_drains_for_a_restart_and_the_idle_node_is_reset_and_resumed(tmp_path):
    # The jobs still on it: drained for a restart (ft's watchdog moves its run off the node).
    busy = "NodeName=node3 State=MIXED Reason=(null)"
    drained, calls = run_healthcheck(tmp_path, 2, node_info=busy, FT_HEALTHCHECK_NODE="node3")
    assert drained.returncode == 1
    assert calls[-1] == ("update nodename=node3 state=drain reason=ft-healthcheck: restart: 10-gpu: "
                         "found 3 of 4 GPU devices")
    # No job left on it: its GPUs are reset (the site's command), the XIDs before are no longer
    # counted (the mark the hooks read), and it is back in service.
    idle = "NodeName=node3 State=IDLE+DRAIN Reason=ft-healthcheck: restart: 10-gpu: found 3 of 4 GPU devices"
    resumed, calls = run_healthcheck(tmp_path, 0, node_info=idle, FT_HEALTHCHECK_NODE="node3",
                                     FT_HC_GPU_RESET=f"touch {tmp_path}/reset-done")
    assert resumed.returncode == 0 and (tmp_path / "reset-done").exists()
    assert calls == ["show node node3 -o", "show node node3 -o", "update nodename=node3 state=resume"]
    boot, mark = (tmp_path / "state" / "node3.xid-after").read_text().split()
    assert boot == Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert abs(float(mark) - float(Path("/proc/uptime").read_text().split()[0])) < 30


def test_a_failed_gpu_reset_leaves_the_node_drained_for_an_admin(tmp_path):
    idle = "NodeName=node3 State=IDLE+DRAIN Reason=ft-healthcheck: restart: 20-ft-health: XID 94"
    failed, calls = run_healthcheck(tmp_path, 0, node_info=idle, FT_HEALTHCHECK_NODE="node3", FT_HC_GPU_RESET="false")
    assert failed.returncode == 1 and "state=resume" not in " ".join(calls)
    # A reason of its own, which ft-healthcheck never resumes, however green the hooks.
    assert calls[-1] == ("update nodename=node3 state=drain reason=ft-healthcheck-hold: GPU reset failed (false): "
                         "needs an admin")


def test_a_drain_for_a_restart_is_kept_while_jobs_are_on_the_node(tmp_path):
    draining = "NodeName=node3 State=MIXED+DRAIN Reason=ft-healthcheck: restart: 20-ft-health: XID 94"
    passed, calls = run_healthcheck(tmp_path, 0, node_info=draining, FT_HEALTHCHECK_NODE="node3",
                                    FT_HC_GPU_RESET=f"touch {tmp_path}/reset-done")
    assert passed.returncode == 0 and calls == ["show node node3 -o"] * 2 and not (tmp_path / "reset-done").exists()


def test_xids_from_before_the_last_reset_no_longer_count(tmp_path):
    from toolkit.health import gpu

    log = (RECORDED / "ecc" / "dmesg.txt").read_text()  # XID 94 and 63 at 5501.1 and 5501.2 s
    assert {f.detail.split(" on ")[0] for f in gpu.xid_findings(log, after=5501.15)} == {"XID 63"}
    assert [f.detail.split(" on ")[0] for f in gpu.xid_findings(log, after=6000)] == ["XID 63"]  # not a restart's
    # The hook reads the mark ft-healthcheck left at the reset, and asks for the restart otherwise.
    hook_env = {"FT_HC_PYTHON": sys.executable, "FT_HC_GPUS_PER_NODE": "2", "FT_HEALTHCHECK_NODE": "node3",
                "FT_HC_RECORDED": str(tmp_path / "{node}"), "FT_HC_STATE_DIR": str(tmp_path / "state")}
    (tmp_path / "node3").mkdir()
    for name in ("nvidia-smi-L.txt", "nvidia-smi-query.csv", "nvidia-smi-nvlink.txt", "meminfo"):
        (tmp_path / "node3" / name).write_text((RECORDED / "healthy" / name).read_text())
    (tmp_path / "node3" / "dmesg.txt").write_text(log.splitlines()[0] + "\n")  # XID 94 alone: a restart
    restart = run_hook(**hook_env)
    assert restart.returncode == 2 and restart.stdout.startswith("restart: gpu_xid: XID 94")
    assert restart.stderr == ""  # ft-healthcheck takes both as the drain reason: no mark yet is no error
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "node3.xid-after").write_text("an-earlier-boot 6000.5\n")
    assert run_hook(**hook_env).returncode == 2  # a mark from another boot: the log is a new one
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    (tmp_path / "state" / "node3.xid-after").write_text(f"{boot} 6000.5\n")
    assert run_hook(**hook_env).returncode == 0


@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="no system Python here")
def test_the_hook_runs_the_installed_copy_with_the_nodes_own_python(tmp_path):
    """What the Ansible role installs (toolkit/health, the standard library only) and runs with the
    node's Python: no ft install, no tie to a checkout; a Python that is gone skips, not drains."""
    import shutil

    for name in ("__init__.py", "health/__init__.py", "health/__main__.py", "health/actions.py", "health/gpu.py",
                 "health/host.py"):
        (tmp_path / "lib" / "toolkit" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(__file__).parents[2] / "toolkit" / name, tmp_path / "lib" / "toolkit" / name)
    node = {"FT_HC_LIB": str(tmp_path / "lib"), "FT_HC_GPUS_PER_NODE": "2", "FT_HC_RECORDED": str(RECORDED / "xid79")}
    drained = subprocess.run([str(HOOK)], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                             env={"PATH": os.environ["PATH"], "FT_HC_PYTHON": "/usr/bin/python3", **node})
    assert drained.returncode == 1 and drained.stdout.startswith("drain: "), drained.stderr
    gone = subprocess.run([str(HOOK)], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={"PATH": os.environ["PATH"], "FT_HC_PYTHON": str(tmp_path / "gone" / "python3"), **node})
    assert gone.returncode == 0 and gone.stdout == ""


def test_a_drain_changed_by_an_admin_while_the_hooks_ran_is_left_alone(tmp_path):
    ours = "NodeName=node3 State=IDLE+DRAIN Reason=ft-healthcheck: 10-gpu: found 3 of 4 GPU devices"
    theirs = "NodeName=node3 State=IDLE+DRAIN Reason=RMA 4711: keep out [admin@2026-11-24T05:00:00]"
    passed, calls = run_healthcheck(tmp_path, 0, node_info=ours, NODE_INFO_AFTER=theirs, FT_HEALTHCHECK_NODE="node3")
    assert passed.returncode == 0 and "update nodename=node3 state=resume" not in calls


def test_a_restart_finding_the_reset_did_not_clear_goes_to_an_admin(tmp_path):
    idle = "NodeName=node3 State=IDLE+DRAIN Reason=ft-healthcheck: restart: 10-gpu: found 3 of 4 GPU devices"
    again, calls = run_healthcheck(tmp_path, 2, node_info=idle, FT_HEALTHCHECK_NODE="node3", FT_HC_GPU_RESET="true")
    assert again.returncode == 1
    assert calls[-1].startswith("update nodename=node3 state=drain reason=ft-healthcheck-hold: 10-gpu: "
                                "still after a GPU reset")


def test_a_restart_reason_that_mentions_a_state_does_not_fool_the_reset(tmp_path):
    busy = "NodeName=node3 State=MIXED+DRAIN Reason=ft-healthcheck: restart: State=IDLE+DRAIN said a log"
    kept, calls = run_healthcheck(tmp_path, 0, node_info=busy, FT_HEALTHCHECK_NODE="node3",
                                  FT_HC_GPU_RESET=f"touch {tmp_path}/reset-done")
    assert kept.returncode == 0 and not (tmp_path / "reset-done").exists()
    assert "update nodename=node3 state=resume" not in calls


def test_a_hook_that_ignores_the_time_limit_is_killed(tmp_path):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "05-stuck").write_text("#!/bin/bash\ntrap '' TERM\nsleep 60\n")
    (hooks / "05-stuck").chmod(0o755)
    began = time.monotonic()
    stuck, calls = run_healthcheck(tmp_path, 0, FT_HEALTHCHECK_NODE="node3", FT_HEALTHCHECK_HOOK_TIMEOUT="1")
    assert stuck.returncode == 1 and time.monotonic() - began < 20
    assert calls[-1].startswith("update nodename=node3 state=drain reason=ft-healthcheck: 05-stuck: "
                                "failed or timed out")


def test_xids_worse_than_a_restart_count_whenever_they_came():
    from toolkit.health import gpu

    log = ("[  100.000000] NVRM: Xid (PCI:0000:2a:00): 94, pid=1, name=python, Contained: CE User Channel\n"
           "[  390.000000] NVRM: Xid (PCI:0000:2a:00): 48, pid=1, name=python, DBE (double-bit ECC)\n")
    assert [f.detail.split(" on ")[0] for f in gpu.xid_findings(log, after=400)] == ["XID 48"]
    assert gpu.xid_findings("[ 1.0] NVRM: Xid (PCI:0000:2a:00): " + "9" * 5000 + ", x\n") == []  # not a code
    for junk in ("nan", "inf", "-1"):
        with pytest.raises(SystemExit):
            main(["--xid-after", junk])
