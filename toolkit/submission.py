"""Submit a run: validate, render, and hand the script to Slurm through submitit.

The script submitit passes to sbatch is exactly ft's rendered script (FtSlurmExecutor swaps
submitit's own template for it), and it is kept in the run directory as job.sbatch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from toolkit.base.errors import FtError
from toolkit.base.shared_dirs import write_atomically
from toolkit.receipts import entries as receipt_entries
from toolkit.recipe.resolve import ResolvedRecipe, resolve
from toolkit.render.sbatch import RunPlacement, render
from toolkit.runs.layout import RunLayout
from toolkit.runs.store import JobRecord, RunRecord, RunStore, validate_key
from toolkit.slurm import commands
from toolkit.slurm.client import CliSlurmClient


class SubmitError(FtError):
    pass


class DataInvalid(FtError):
    exit_code = 1


def check_data(resolved: ResolvedRecipe) -> list:
    """The data checks of `ft validate`; errors stop the submission before anything is written."""
    from toolkit.data.recipe_data import validate_recipe_data

    reports = validate_recipe_data(resolved)
    bad = [report for report in reports if not report.ok]
    if bad:
        lines = []
        for report in bad:
            for kind, summary in sorted(report.errors.items()):
                first = "; ".join(str(finding) for finding in summary.examples[:3])
                lines.append(f"  {kind} x{summary.count}: {first}")
        raise DataInvalid("the data would fail this run; nothing was submitted:\n" + "\n".join(lines),
                          hint=f"see every problem with `ft validate {resolved.path}`; --skip-validation "
                               "submits anyway")
    return reports


@dataclass
class Submission:
    run: RunRecord
    run_dir: Path
    created: bool  # False: an earlier submission with the same idempotency key was returned
    warnings: list[str] = field(default_factory=list)


def mirror_warnings(resolved: ResolvedRecipe, run_id: str) -> list[str]:
    """What the user should know before the job runs: checkpoints bound for an object store that
    this environment (which the job inherits) has no credentials for."""
    from toolkit.checkpoint.remote import mirror_url

    url = mirror_url(resolved.recipe.checkpoint.s3_mirror, resolved.profile.s3_prefix, run_id)
    if url is None or resolved.profile.object_store.credentials_visible():
        return []
    lab = ' (the lab\'s: eval "$(ft lab env)")' if resolved.profile.name == "lab" else ""
    return [f"checkpoints will be mirrored to {url}, but this environment has no S3 credentials (AWS_ACCESS_KEY_ID "
            f"or AWS_PROFILE){lab}: the job inherits it, so its uploads will fail (training is not affected; "
            "`ft status` shows the mirror)"]


def _executor(folder: Path, script: str):
    import submitit

    class FtSlurmExecutor(submitit.SlurmExecutor):
        """submitit's Slurm executor with ft's rendered script as the submission file."""

        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return script

    return FtSlurmExecutor(folder=folder)


def _sbatch(run_dir: Path, script: str) -> str:
    os.environ.setdefault("SLURM_CONF", commands.slurm_env()["SLURM_CONF"])  # never let sbatch ask DNS
    folder = RunLayout(run_dir).submitit
    folder.mkdir(exist_ok=True)
    executor = _executor(folder, script)
    try:
        with script_directives_win():
            job = executor._submit_command("ft-run")  # the script above is the whole job; no pickle
    except Exception as exc:  # noqa: BLE001 - submitit raises FailedJobError/CalledProcessError with sbatch's text
        raise SubmitError(f"sbatch refused the job: {exc}".strip(),
                          hint=f"the rendered script is in {RunLayout(run_dir).script}") from None
    return str(job.job_id)


@contextlib.contextmanager
def script_directives_win():
    """sbatch takes SBATCH_* variables of its environment over the script's #SBATCH lines: the job
    would run under another account, QOS or partition than the one ft checked and rendered. Left out
    of sbatch's environment (said, not silent)."""
    overriding = {name: os.environ.pop(name) for name in list(os.environ) if name.startswith("SBATCH_")}
    if overriding:
        print(f"warning: {', '.join(sorted(overriding))} left out of sbatch's environment: the rendered "
              "script's #SBATCH lines say what this job asks for (set it in the recipe or the cluster profile)",
              file=sys.stderr)
    try:
        yield
    finally:
        os.environ.update(overriding)


def data_digests(resolved: ResolvedRecipe) -> dict:
    """Each data file's sha256 for the run's receipt (a local file's size and path with it: `ft
    receipt verify` reads it again); the data checks hashed it already (one read, remembered)."""
    from toolkit.data.cache import file_digest
    from toolkit.receipts.chain import Digest

    store, found = resolved.profile.object_store, {}
    for role, path in resolved.recipe.data_files().items():
        try:
            digest = file_digest(path, store)
            found[role] = digest if "://" in path else Digest(Path(path), os.path.getsize(path), digest)
        except (OSError, FtError) as exc:
            raise SubmitError(f"the {role} data {path} cannot be read for the run's receipt: {exc}",
                              hint="check the path (ft validate names what is wrong with the data)") from None
    return found


def require_training_environment(resolved: ResolvedRecipe) -> None:
    """The compute nodes must have something to train with before a job is queued: the check
    `ft doctor` makes from the login node (a prepared venv of this very ft, or an interpreter with
    the training stack)."""
    from toolkit.doctor.login import check_environment

    for finding in check_environment(resolved.profile):
        if finding.level == "blocker":
            raise SubmitError(f"cluster {resolved.profile.name}: {finding.detail}", hint=finding.fix)


def require_checkpoint_key(resolved: ResolvedRecipe) -> None:
    """The user's checkpoint key (toolkit/checkpoint/seal.py), made here where there is none: a key
    folder another user took is refused before anything is queued, not found by rank 0 later."""
    from toolkit.checkpoint.seal import key_path, load_or_make_key

    try:
        load_or_make_key(key_path(resolved.profile.shared_root))
    except (OSError, ValueError) as exc:
        raise FtError(f"your checkpoint key cannot be read or made: {exc}",
                      hint="it proves which checkpoints are yours; ask the cluster's admins to remove what is "
                           "in its place") from None


def store_for(resolved: ResolvedRecipe) -> RunStore:
    return RunStore.for_shared_root(resolved.profile.shared_root)


def submit(recipe_path: Path, cluster: str | None = None, idempotency_key: str | None = None,
           mode: str = "train", skip_validation: bool = False, prefer: str = "cheapest",
           max_wait_s: float | None = None) -> Submission:
    """Submit the recipe to `cluster` (a profile's name; "auto": where the broker's choice by `prefer`
    puts it, recorded with why in the run's plan.json)."""
    plan = None
    if cluster == "auto":
        from toolkit.cluster import broker
        from toolkit.cluster.profile import available_profiles

        found = broker.options(recipe_path, available_profiles())
        best, why = broker.choose(found, prefer, broker.DEFAULT_MAX_WAIT_S if max_wait_s is None else max_wait_s)
        cluster, plan = best.cluster, {"chosen": best.to_dict(), "why": why, "prefer": str(prefer),
                                       "options": [option.to_dict() for option in found]}
    resolved = resolve(recipe_path, cluster)
    if plan is not None:
        resolved = resolved.with_tier(plan["chosen"]["tier"])
    require_training_environment(resolved)
    store = store_for(resolved)
    require_checkpoint_key(resolved)

    def new_run(key: str | None) -> Submission:
        from toolkit.account import quota

        warnings = quota.check(resolved)  # refuses past the account's cap (a preflight holds the nodes too)
        reports = [] if skip_validation or mode == "preflight" else check_data(resolved)
        return _submit_new(resolved, store, key, mode, reports, plan, warnings)

    if idempotency_key is None:
        return new_run(None)
    validate_key(idempotency_key)
    with store.key_lock(idempotency_key):
        existing = store.run_for_key(idempotency_key)
        if existing:  # already submitted: nothing to check again (the quota included: it is spent)
            return Submission(store.load(existing), store.run_dir(existing), created=False)
        submission = new_run(idempotency_key)
        store.remember_key(idempotency_key, submission.run.run_id)
        return submission


def _submit_new(resolved: ResolvedRecipe, store: RunStore, key: str | None, mode: str,
                reports: list, plan: dict | None = None, warnings: list[str] = ()) -> Submission:
    version = CliSlurmClient().version()  # this cluster's Slurm decides which options the script uses
    run_id = store.claim_run_dir(resolved.recipe.name)
    run_dir = store.run_dir(run_id)
    layout = RunLayout(run_dir)
    try:
        script = render(resolved, RunPlacement(run_id, str(run_dir), key), mode=mode, slurm_version=version)
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)  # errors here leave nothing
        raise
    shutil.copyfile(resolved.path, layout.recipe_source)
    write_atomically(layout.recipe_resolved,
                     yaml.safe_dump(resolved.recipe.model_dump(mode="json"), sort_keys=False))
    write_atomically(layout.script, script, mode=0o700)
    if plan is not None:
        write_atomically(layout.plan, json.dumps(plan, indent=1) + "\n")
    if reports:
        write_atomically(layout.data_report,
                         json.dumps([report.to_dict() for report in reports], indent=1) + "\n")
    record = RunRecord(run_id, resolved.recipe.name, str(resolved.path.resolve()), resolved.profile.name, mode,
                       time.time(), key)
    try:
        # A preflight job reads no data (its recipe's may not exist yet): no data digests.
        receipt_entries.submitted(run_dir, resolved, data_digests(resolved) if mode == "train" else {})
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    store.save(record)
    try:
        job_id = _sbatch(run_dir, script)
    except SubmitError:
        shutil.rmtree(run_dir, ignore_errors=True)  # nothing half-done: no run without a job
        raise
    record = store.add_job(run_id, JobRecord(job_id, time.time()))  # the job may have registered first
    return Submission(record, run_dir, created=True, warnings=[*warnings, *mirror_warnings(resolved, run_id)])
