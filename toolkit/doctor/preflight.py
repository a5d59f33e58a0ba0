"""The compute side of `ft doctor`: one short srun step over a few nodes of the standard tier, with
the profile's partition, QOS, account, container and fabric variables, running compute.py with the
interpreter jobs will use. Its output comes back through srun, so a shared root that the nodes
cannot write does not hide the answer."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

from toolkit.base.build import build_id
from toolkit.base.errors import FtError
from toolkit.base.shared_dirs import user_cache
from toolkit.cluster.profile import ClusterProfile
from toolkit.doctor.findings import Finding, blocker, merge_nodes, ok, warn
from toolkit.slurm import commands
from toolkit.slurm.steps import ShortStep

# Runs on each node before any Python of the user's: says which of the interpreter and ft is missing.
WRAPPER = r"""
python=$1 node=$(hostname)
if ! command -v "$python" >/dev/null 2>&1; then echo "FT-DOCTOR-MISSING $node python"; exit 0; fi
if ! "$python" -c 'import toolkit' >/dev/null 2>&1; then echo "FT-DOCTOR-MISSING $node ft"; exit 0; fi
if ! "$python" -c 'import toolkit.doctor.node' >/dev/null 2>&1; then echo "FT-DOCTOR-MISSING $node other-ft"; exit 0; fi
exec "$python" -m toolkit.doctor.node "$2"
"""
# Beside a container: the job script's own steps run on the host, with the login node's install.
BATCH_WRAPPER = r"""
python=$1 node=$(hostname)
if ! "$python" -c 'import toolkit.job.controller' >/dev/null 2>&1; then echo "FT-DOCTOR-MISSING $node batch"; fi
echo "FT-DOCTOR-DONE $node 0"
"""


def token_file(profile: ClusterProfile) -> Path:
    """A file only this login node could have written, that each node reads back (the same
    filesystem) and answers beside (writable, and visible from here), in this user's own cache
    folder on the shared root."""
    token = user_cache(profile.shared_root) / f"doctor-token-{secrets.token_hex(6)}"
    token.write_text(token.name)
    return token


def short_step(profile: ClusterProfile, nodes: int, wait_s: int, in_image: bool) -> ShortStep:
    """The doctor's step, placed as the profile's jobs are (in their image where `in_image`)."""
    standard = profile.standard_tier
    return ShortStep(nodes, standard.partition, "ft-doctor", wait_s, qos=standard.qos or None,
                     account=profile.default_account or None, gpus_per_node=profile.gpus_per_node or 0,
                     container_image=profile.container_image if in_image and profile.in_container else None,
                     container_mounts=str(profile.shared_root) if in_image and profile.in_container else None)


def srun_argv(profile: ClusterProfile, nodes: int, wait_s: int, python: str, args: dict) -> list[str]:
    return short_step(profile, nodes, wait_s, in_image=True).argv("bash", "-c", WRAPPER, "ft-doctor", python,
                                                                  json.dumps(args))


def refused(stderr: str, profile: ClusterProfile) -> Finding:
    """Slurm's refusal of the preflight step, as a finding with its fix."""
    text = stderr.strip().splitlines()[-1] if stderr.strip() else "srun failed without a message"
    lowered = text.lower()
    if "immediate" in lowered or "unable to allocate resources" in lowered and "busy" in lowered:
        return warn("preflight", f"no nodes free for the preflight step in time ({text}): compute checks not run",
                    "run `ft doctor` again later, or with --nodes 1")
    if "account" in lowered or "association" in lowered:
        return blocker("account", f"Slurm refused the preflight step: {text}",
                       f"ft cluster set {profile.name} default_account=<one of yours: sacctmgr show assoc user=$USER>")
    if "partition" in lowered:
        return blocker("partition", f"Slurm refused the preflight step: {text}",
                       f"ft cluster set {profile.name} tiers.standard.partition=<sinfo -s>")
    return blocker("preflight", f"Slurm refused the preflight step: {text}", "read the message; `ft doctor --json`")


def compute_checks(profile: ClusterProfile, nodes: int = 2, wait_s: int = 120) -> list[Finding]:
    try:
        token = token_file(profile)
    except (FtError, OSError) as exc:  # the login checks say what is wrong with the shared root
        token = None
        unusable = blocker("shared_root", f"the shared root cannot hold doctor's test file: "
                                          f"{getattr(exc, 'message', exc)}",
                           getattr(exc, "hint", None) or f"ft cluster set {profile.name} shared_root=...")
    python = profile.training_python(sys.executable)
    args = {"profile": profile.name, "login_build": build_id(), "token": str(token or "/nonexistent"),
            "token_value": token.name if token else "", "fabric": profile.fabric,
            "gpus_per_node": profile.gpus_per_node, "cpu_workers": profile.cpu_workers_per_node,
            "s3_prefix": profile.s3_prefix, "s3_endpoint": profile.s3_endpoint, "lab": profile.name == "lab",
            "compute_internet": profile.compute_internet}
    try:
        done = run_step(srun_argv(profile, nodes, wait_s, python, args), profile, wait_s)
        if isinstance(done, Finding):
            return [done]
        findings = read_reports(done, profile, python, token, nodes)
        if profile.in_container:
            findings += batch_host_checks(profile, wait_s)
        return findings if token else [unusable, *findings]
    finally:
        if token:
            for path in token.parent.glob(token.name + "*"):
                path.unlink(missing_ok=True)


def run_step(argv: list[str], profile: ClusterProfile, wait_s: int) -> subprocess.CompletedProcess | Finding:
    env = commands.slurm_env() | profile.nccl_env
    try:
        return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=wait_s + 120,
                              stdin=subprocess.DEVNULL, check=False)
    except FileNotFoundError:
        return blocker("preflight", "srun is not installed here", "load Slurm's client tools (`module load slurm`)")
    except subprocess.TimeoutExpired:
        return blocker("preflight", f"the preflight step did not end within {wait_s + 120} s",
                       "look at `squeue -u $USER -n ft-doctor`; run `ft doctor` again later")


def batch_host_checks(profile: ClusterProfile, wait_s: int) -> list[Finding]:
    """The job script's own steps (register, watchdog, requeue) run outside the container with the
    login node's install: it must be on a filesystem the compute nodes share."""
    argv = short_step(profile, 1, wait_s, in_image=False).argv("bash", "-c", BATCH_WRAPPER, "ft-doctor",
                                                               sys.executable)
    done = run_step(argv, profile, wait_s)
    if isinstance(done, Finding):
        return [done]
    if "FT-DOCTOR-MISSING" in done.stdout:
        return [blocker("environment", f"the job script's own steps run {sys.executable} on the compute nodes, "
                                       "outside the container, and it does not import ft there",
                        "install ft where the compute nodes see it (scripts/install-user.sh into your home "
                        "or the shared filesystem, FT_HOME=...)")]
    return [ok("environment", f"{sys.executable} runs ft's batch steps on the compute nodes (outside the image)")]


def read_reports(done: subprocess.CompletedProcess, profile: ClusterProfile, python: str, token: Path | None,
                 nodes: int) -> list[Finding]:
    findings: list[Finding] = []
    answered = []
    prepare = f"ft cluster prepare {profile.name}"
    for labelled in done.stdout.splitlines():
        line = labelled.partition(": ")[2] if labelled.split(":", 1)[0].strip().isdigit() else labelled
        if line.startswith("FT-DOCTOR-MISSING "):
            _, node, what = (line.split() + ["", ""])[:3]
            answered.append(node)
            findings.append(blocker(
                "environment", f"{python} does not exist on the compute nodes" if what == "python"
                else f"{python} on the compute nodes holds another ft, built before this one's checks (no "
                     "toolkit.doctor.node there)" if what == "other-ft"
                else f"ft does not import with {python} on the compute nodes (no training environment there)",
                prepare, where=node))
        elif line.startswith("FT-DOCTOR-DONE "):
            answered.append(line.split()[1])
        elif line.startswith("FT-DOCTOR "):
            try:
                findings.append(Finding(**json.loads(line.removeprefix("FT-DOCTOR "))))
            except (json.JSONDecodeError, TypeError):
                continue  # a line lost in transit: its node may still answer DONE
    if token:
        for node in answered:
            wrote = any(f.check == "shared_root" and f.level == "ok" and f.where == node for f in findings)
            if wrote and not Path(f"{token}.{node}").exists():
                findings.append(blocker("shared_root", "a file the node wrote in the shared root is not visible "
                                        "from the login node", f"ft cluster set {profile.name} shared_root=...",
                                        where=node))
    if not answered:
        return [refused(done.stderr, profile)]
    if len(answered) < nodes:
        findings.append(warn("preflight", f"{nodes - len(answered)} of {nodes} nodes did not answer: "
                                          f"{done.stderr.strip()[-200:]}", "ft doctor --json; sinfo -R"))
    findings.append(ok("preflight", f"checked on {len(answered)} compute node(s): {', '.join(sorted(answered))}"))
    return merge_nodes(findings)
