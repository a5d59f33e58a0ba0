"""What `ft doctor` checks on a compute node, run there by the preflight step with the interpreter
jobs will use: `python -m toolkit.doctor.node ARGS-JSON`. Prints a JSON line per finding.

It imports the training stack (that is the point: the job will), so it never runs on the login node."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

from toolkit.doctor.findings import Finding, blocker, ok, warn


def interface_problem(variable: str, value: str, available: list[str]) -> str | None:
    """NCCL's *_IFNAME / NCCL_IB_HCA syntax: '^a,b' excludes, '=a' is exact, else prefixes; a ':port'
    suffix is allowed. Why the value matches nothing here, or None."""
    if not value:
        return None
    if value.startswith("^"):  # all but these: something must be left
        excluded = [item.split(":")[0] for item in value[1:].lstrip("=").split(",") if item]
        if any(not any(name.startswith(prefix) for prefix in excluded) for name in available):
            return None
        return f"{variable}={value} excludes every device here (found: {', '.join(available) or 'none'})"
    exact = value.startswith("=")
    wanted = [item.split(":")[0] for item in value.lstrip("=").split(",") if item]
    matched = [name for name in available if any(name == w if exact else name.startswith(w) for w in wanted)]
    if matched:
        return None
    return f"{variable}={value} matches no device here (found: {', '.join(available) or 'none'})"


def listdir(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def check_fabric(args: dict, environ: dict[str, str]) -> list[Finding]:
    findings = []
    interfaces, hcas = listdir("/sys/class/net"), listdir("/sys/class/infiniband")
    for variable in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        problem = interface_problem(variable, environ.get(variable, ""), interfaces)
        if problem:
            findings.append(blocker("fabric", problem, f"set {variable} in the profile's nccl_env to one of these "
                                    f"(ft cluster set {args['profile']} nccl_env.{variable}=...)"))
    problem = interface_problem("NCCL_IB_HCA", environ.get("NCCL_IB_HCA", ""), hcas)
    if problem:
        findings.append(blocker("fabric", problem, f"ft cluster set {args['profile']} nccl_env.NCCL_IB_HCA=..."))
    if environ.get("FI_PROVIDER") == "efa" and not any("efa" in name for name in hcas):
        findings.append(blocker("fabric", "FI_PROVIDER=efa but no EFA device (/sys/class/infiniband)",
                                f"use an EFA instance type, or ft cluster set {args['profile']} fabric=none"))
    if args["fabric"] in ("efa", "infiniband", "roce") and not hcas:
        findings.append(warn("fabric", f"the profile says fabric {args['fabric']}, but no RDMA device is here: "
                                       "NCCL falls back to TCP sockets (slow across nodes)",
                             f"ft cluster set {args['profile']} fabric=none, or ask the admins about the RDMA driver"))
    if not findings:
        findings.append(ok("fabric", f"fabric {args['fabric']}: its variables match this node's devices"))
    return findings


def check_gpus(args: dict) -> list[Finding]:
    import torch

    if args["cpu_workers"]:
        return [ok("gpus", f"CPU workers ({args['cpu_workers']} per node, gloo): no GPU needed")]
    if not args["gpus_per_node"]:
        return [ok("gpus", "the profile asks for no GPUs")]
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < args["gpus_per_node"]:
        return [blocker("gpus", f"torch sees {found} GPUs, the profile asks {args['gpus_per_node']} per node",
                        "check the driver (nvidia-smi) and that torch was built for CUDA (ft cluster prepare)")]
    return [ok("gpus", f"{found} GPUs ({torch.cuda.get_device_name(0)})")]


def check_shared(args: dict, node: str) -> list[Finding]:
    token = Path(args["token"])
    fix = f"ft cluster set {args['profile']} shared_root=/a/folder/every/node/shares"
    try:
        seen = token.read_text().strip()
    except OSError as exc:
        return [blocker("shared_root", f"the login node's file {token} is not here ({exc.strerror}): "
                                       "the shared root is not the same filesystem on this node", fix)]
    if seen != args["token_value"]:
        return [blocker("shared_root", f"{token} holds other content here: not the login node's filesystem", fix)]
    try:
        Path(f"{token}.{node}").write_text(node)
    except OSError as exc:
        return [blocker("shared_root", f"the shared root is not writable here ({exc.strerror})", fix)]
    return [ok("shared_root", "the shared root is the login node's, and writable")]


def check_versions(args: dict) -> list[Finding]:
    from importlib import metadata

    from toolkit.base.build import build_id

    versions = {}
    for name in ("torch", "transformers", "peft", "deepspeed"):
        try:
            __import__(name)
            versions[name] = metadata.version(name)
        except Exception as exc:  # noqa: BLE001 - an import that fails is the finding
            return [blocker("environment", f"{name} does not import with {sys.executable}: {exc}"[:300],
                            f"ft cluster prepare {args['profile']}")]
    here = build_id()
    stack = ", ".join(f"{name} {version}" for name, version in versions.items())
    if here != args["login_build"]:
        return [blocker("ft_version", f"ft {here} on compute nodes, {args['login_build']} on the login node "
                                      f"(jobs would run other code than you tested)",
                        f"ft cluster prepare {args['profile']}")]
    return [ok("ft_version", f"ft {here} (as on the login node); {stack}")]


def check_object_store(args: dict) -> list[Finding]:
    if not args["s3_prefix"]:
        return [ok("object_store", "no object store in the profile: checkpoints stay on the shared filesystem")]
    fix = ("export AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) before ft submit"
           + ('; on the lab: eval "$(ft lab env)"' if args["lab"] else ""))
    from toolkit.storage.object_store import ObjectStore, within

    store = ObjectStore(args["s3_endpoint"])
    if not store.credentials_visible():
        return [warn("object_store", f"no S3 credentials in the environment: checkpoint mirrors to "
                                     f"{args['s3_prefix']} would fail (training is not affected)", fix)]

    def list_bucket() -> object:
        from toolkit.checkpoint.remote import user_prefix

        # The user's own place: a site with per-user credentials may let them list nothing else.
        filesystem, path = store.filesystem(user_prefix(args["s3_prefix"]))
        return filesystem.find(path, maxdepth=1)

    try:
        import s3fs  # noqa: F401 - what the checkpoint mirror uploads with
    except ImportError:
        return [blocker("object_store", f"s3fs is not installed in {sys.executable}: checkpoint mirrors to "
                                        f"{args['s3_prefix']} cannot work", f"ft cluster prepare {args['profile']}")]
    answer = within(list_bucket, 20)
    if not answer.in_time or answer.error is not None:
        why = f"{type(answer.error).__name__}: {answer.error}" if answer.error else "no answer within 20 s"
        return [warn("object_store", f"{args['s3_prefix']} does not answer with these credentials ({why})"[:400],
                     fix)]
    return [ok("object_store", f"{args['s3_prefix']} answers")]


def check_wandb(environ: dict[str, str], internet: bool = True) -> list[Finding]:
    mode = environ.get("WANDB_MODE", "")
    if mode in ("offline", "disabled", "dryrun"):
        return [ok("wandb", f"WANDB_MODE={mode}: nothing to reach (`wandb sync` an offline run from the login node)")]
    if not internet:  # said by the profile: nothing public is probed from these nodes
        return [warn("wandb", "the profile says compute nodes reach no internet (compute_internet: false), and "
                              "WANDB_MODE is not offline: runs whose recipe logs online cannot start W&B",
                     "set tracking.wandb.mode: offline in the recipe (or export WANDB_MODE=offline) and "
                     "`wandb sync` from the login node")]
    url = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=5):
            pass
    except OSError as exc:
        return [warn("wandb", f"{url.hostname}:{port} is unreachable ({exc.strerror or exc}): runs whose recipe "
                              "logs online will fail to start W&B", "set tracking.wandb.mode: offline in the recipe "
                              "(or export WANDB_MODE=offline) and `wandb sync` from the login node")]
    return [ok("wandb", f"{url.hostname}:{port} answers")]


CHECKS = ("versions", "gpus", "shared", "fabric", "object_store", "wandb")


def run_checks(args: dict, node: str) -> list[Finding]:
    """Each check on its own: one that fails to run is a warning naming it, and the others still run."""
    environ = dict(os.environ)
    internet = bool(args.get("compute_internet", True))
    checks = {"versions": lambda: check_versions(args), "gpus": lambda: check_gpus(args),
              "shared": lambda: check_shared(args, node), "fabric": lambda: check_fabric(args, environ),
              "object_store": lambda: check_object_store(args), "wandb": lambda: check_wandb(environ, internet)}
    findings: list[Finding] = []
    for name in CHECKS:
        if name == "gpus" and findings and findings[0].level != "ok":
            continue  # the training stack does not import: nothing to ask torch
        try:
            findings += checks[name]()
        except Exception as exc:  # noqa: BLE001 - the check's own failure, whatever it is: reported, not fatal
            findings.append(warn(name, f"the check could not run: {type(exc).__name__}: {exc}"[:400],
                                 "ft doctor --json shows every finding; report it if it persists"))
    return findings


def main() -> None:
    args = json.loads(sys.argv[1])
    node = socket.gethostname()
    started = time.monotonic()
    findings = run_checks(args, node)
    # One short line per finding: srun splits long lines (about 1 KB) of a task's output.
    for finding in findings:
        item = finding.to_dict() | {"where": node, "detail": finding.detail[:400], "fix": finding.fix[:300]}
        print("FT-DOCTOR " + json.dumps(item), flush=True)
    print(f"FT-DOCTOR-DONE {node} {time.monotonic() - started:.1f}", flush=True)

if __name__ == "__main__":
    main()
