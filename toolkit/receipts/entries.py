"""What a run records in its receipt, and where (toolkit/receipts/chain.py keeps the chain):

    submit      `ft submit`, before sbatch: ft's version and code commit, the resolved recipe and the
                job script, each data file's digest, the container image where one is used
    attempt     the watchdog, at each start: the job, its nodes and spares, the topology
    attempt_end the watchdog, as a start ends: its exit code and class; then the receipt is sealed
    checkpoint  rank 0, as a checkpoint is whole: its manifest (every file's sha256 is in it)
    adapter     rank 0, at the end: the output folder (every file), the evaluation and its verdict,
                the registry's version; then sealed

Inside the job a receipt that cannot be written is said in the log and never stops training (the
receipt then fails `ft receipt verify`, naming the gap); at submit it stops the submission, before
anything is queued. Sealing asks the site's signer (its socket: the run spec's site.receipt_signer) while the job runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from toolkit.base.build import VERSION
from toolkit.base.errors import FtError
from toolkit.receipts.chain import Digest, Receipt
from toolkit.runs import exits
from toolkit.runs.layout import RunLayout

EXIT_CLASSES = {exits.DONE: "done", exits.USER_ERROR: "user error", exits.OUT_OF_MEMORY: "out of memory",
                exits.HUNG: "hung rank", exits.NODES_LOST: "nodes lost", exits.STOPPED: "stopped, checkpointed"}


def code_commit() -> str | None:
    """The git commit of ft's own code, where it runs from a checkout (a wheel has its version only)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        found = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                               timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() or None


def image_digest(image: str) -> str | None:
    """The container image's digest where its reference pins one (registry/image@sha256:...): a tag
    can be moved to other bytes, a digest cannot. None for a tag (pin the profile's image by digest
    to have it recorded) or no container."""
    _, at, digest = (image or "").partition("@")
    return digest if at and re.fullmatch(r"sha256:[0-9a-f]{64}", digest) else None


def submitted(run_dir: Path, resolved, data_digests: dict[str, Digest | str]) -> None:
    """The first entry, written before the job is queued (FtError: nothing is submitted)."""
    layout, profile = RunLayout(run_dir), resolved.profile
    artifacts = {"recipe": layout.recipe_resolved, "job_script": layout.script}
    artifacts |= {f"data.{role}": digest for role, digest in data_digests.items() if isinstance(digest, Digest)}
    body = {"run_id": run_dir.name, "ft_version": VERSION, "code_commit": code_commit(),
            "recipe": resolved.recipe.name,
            "cluster": profile.name, "account": resolved.recipe.resources.account or profile.default_account,
            "data": {role: digest.sha256 if isinstance(digest, Digest) else digest
                     for role, digest in data_digests.items()},
            "container_image": profile.container_image or None,
            "container_digest": image_digest(profile.container_image),
            "container_runtime": profile.container_runtime or None}
    Receipt(run_dir).append("submit", body, {name: path for name, path in artifacts.items()
                                              if not isinstance(path, Path) or path.exists()})


# This process's time in receipt work (appends, hashing, seals): rank 0 reports it in the run's
# summary (receipt_seconds), against the run's wall clock (benchmarks/RECEIPTS.md).
spent_seconds = 0.0


def in_job(run_dir: Path, kind: str, body: dict, artifacts: dict | None = None, seal: bool = False,
           prunable: bool = False) -> None:
    """An entry from inside the job (and the seal after it): never fatal, said in the job's log."""
    global spent_seconds
    began = time.monotonic()
    try:
        record(run_dir, kind, body, artifacts, seal, prunable)
    finally:
        spent_seconds += time.monotonic() - began


def record(run_dir: Path, kind: str, body: dict, artifacts: dict | None, seal: bool, prunable: bool) -> None:
    receipt = Receipt(run_dir)
    try:
        receipt.append(kind, body, artifacts, prunable=prunable)
    except FtError as exc:
        print(f"ft: the receipt's {kind} entry was not written: {exc.message}", file=sys.stderr, flush=True)
        return
    if seal:
        sealed(receipt, signer_of(run_dir))


SEAL_TRIES = 4  # a signer busy or restarting is asked again, 1, 2 then 4 s later


def signer_of(run_dir: Path) -> str:
    """The site's signer (its socket), as the run spec names it; '' where there is none."""
    from toolkit.runs.layout import RunLayout, RunSpecError

    try:
        return RunLayout(run_dir).read_spec().site.receipt_signer
    except RunSpecError:
        return ""


def sealed(receipt: Receipt, socket: str, pause: float = 1.0) -> None:
    if not socket:
        return  # no signer on this cluster: the receipt stays unsigned, and verify says so
    for attempt in range(SEAL_TRIES):
        try:
            receipt.seal(socket)
            return
        except FtError as exc:
            if "did not answer" not in exc.message or attempt == SEAL_TRIES - 1:  # a refusal is final
                print(f"ft: the receipt was not signed: {exc.message}", file=sys.stderr, flush=True)
                return
            time.sleep(pause * 2 ** attempt)


def attempt(run_dir: Path, start: int, nodes: list[str], spares: list[str]) -> None:
    topology = {"nodes": len(nodes), "gpus_per_node": int(os.environ.get("SLURM_GPUS_ON_NODE", "0") or 0),
                "partition": os.environ.get("SLURM_JOB_PARTITION"), "cluster": os.environ.get("SLURM_CLUSTER_NAME")}
    in_job(run_dir, "attempt", {"job": os.environ.get("SLURM_JOB_ID"), "start": start,
                                "requeue": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
                                "nodes": nodes, "spares": spares, "topology": topology})


def attempt_ended(run_dir: Path, code: int | None, why: str | None = None) -> None:
    exit_class = EXIT_CLASSES.get(code, "a rank died or a collective broke") if code is not None else "unknown"
    in_job(run_dir, "attempt_end", {"job": os.environ.get("SLURM_JOB_ID"), "code": code, "class": exit_class,
                                    "why": why}, seal=True)


def checkpoint(run_dir: Path, step: int, manifest: Path) -> None:
    in_job(run_dir, "checkpoint", {"step": step}, {"manifest": manifest}, prunable=True)


def finished(run_dir: Path, step: int, registry: dict | None) -> None:
    """The adapter (or model) made, its evaluation and where the registry keeps it; then sealed."""
    layout = RunLayout(run_dir)
    artifacts = {"output": layout.output} | ({"evaluation": layout.evaluation} if layout.evaluation.exists() else {})
    in_job(run_dir, "adapter", {"step": step, "registry": registry}, artifacts, seal=True)
