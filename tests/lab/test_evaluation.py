"""From a trained adapter to a trusted one, on the real lab: the tiny recipe's run (the session's
uninterrupted one) is evaluated against its base model inside its allocation, passes its gates, is
promoted in the adapter registry and leaves a receipt the site's signer signed; a run that does not
beat its base stays a draft; and any byte changed in what the receipt records is caught and named."""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path

import pytest
import yaml

from tests.support.prometheus import query
from tests.support.training import ft, lab_runs, submit, tiny_recipe, wait_done
from toolkit.receipts.verify import FAILED_EXIT, verify

pytestmark = pytest.mark.slow


@pytest.mark.slurm_matrix
def test_the_tiny_run_is_evaluated_promoted_and_its_receipt_verifies(lab, tiny_baseline):
    run_id, run_dir = tiny_baseline["run_id"], Path(tiny_baseline["run_dir"])
    results = json.loads((run_dir / "eval.json").read_text())
    base, trained = results["base"], results["adapter"]
    assert trained["held_out"]["loss"] < base["held_out"]["loss"] - 1.0, results  # its gate: 1 nat below
    assert set(trained["golden"]["metrics"]) == {"exact_match", "token_f1"}
    assert results["state"] == "promoted" and results["passed"] and all(g["passed"] for g in results["gates"])
    registry = results["registry"]
    assert registry["state"] == "promoted", registry
    shown = ft("adapters", "show", registry["version"], "--json")
    assert shown.returncode == 0, shown.stderr
    version = json.loads(shown.stdout)
    # Promoted (by this run, or by an earlier one whose adapter was the same bytes: one version); other
    # runs of the tiny recipe in this session may have superseded it since (a name serves one version):
    # deprecated then, and said so.
    moves = [(move["from"], move["to"], move["reason"]) for move in version["history"]]
    assert ("draft", "promoted") in [move[:2] for move in moves], moves
    assert version["state"] == "promoted" or moves[-1][2].startswith("superseded by"), moves
    assert version["base_model"] == "tiny-llama" and version["files_as_registered"]
    serving = json.loads(Path(version["serving"]).read_text())
    assert serving["base_model"]["name"] == "tiny-llama"
    assert "adapter_model.safetensors" in serving["adapter"]["files"] and serving["lora"]["rank"] == 16

    # Mirrored to the lab's S3 by `ft adapters sync` (the job had no object store credentials here:
    # it said so, and kept the version on the shared filesystem).
    synced = ft("adapters", "sync", "--json", env=lab.object_store.env)
    assert synced.returncode == 0, synced.stdout + synced.stderr
    from tests.support.s3 import filesystem

    key = f"ft-checkpoints/registry/versions/{registry['version']}/adapter/adapter_model.safetensors"
    local = Path(version["adapter"]) / "adapter_model.safetensors"
    assert filesystem(lab.object_store.env).cat_file(key) == local.read_bytes()

    status = ft("status", run_id, runs_dir=run_dir.parent)
    assert "eval: promoted" in status.stdout and f"version {registry['version'][:12]} promoted" in status.stdout

    verified = ft("receipt", "verify", run_id, "--json", runs_dir=run_dir.parent)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    receipt = json.loads(verified.stdout)
    kinds = [json.loads(line)["kind"] for line in (run_dir / "receipt.jsonl").read_text().splitlines()]
    assert kinds[0] == "submit" and "attempt" in kinds and "checkpoint" in kinds and "adapter" in kinds, kinds
    assert receipt["signed"]["user"] == "root" and receipt["signed"]["job_id"] == tiny_baseline["job_id"]
    # The signer read the job's batch script from Slurm: it is the script entry 1 records.
    submitted = json.loads((run_dir / "receipt.jsonl").read_text().splitlines()[0])
    assert receipt["signed"]["job_script"] == submitted["artifacts"]["job_script"]["sha256"]
    assert receipt["vouched"]["checked"] == [1] and "the user's own word" in receipt["vouched"]["says"]

    # Prometheus's last scrape of the run (the watchdog waits for it) carried the evaluation.
    promoted = query(lab.prometheus, f'last_over_time(ft_run_eval_promoted{{run="{run_id}"}}[1h])')
    assert promoted and float(promoted[0]["value"][1]) == 1.0
    losses = query(lab.prometheus, f'last_over_time(ft_run_eval_loss{{run="{run_id}", split="held_out"}}[1h])')
    assert {series["metric"]["model"] for series in losses} == {"base", "adapter"}
    # W&B (offline on the lab: `ft sync` uploads it) has it in the run's summary, in its record file.
    (records,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    recorded = records.read_bytes()
    assert b"eval/state" in recorded and b"eval/adapter/held_out/loss" in recorded
    timing = json.loads((run_dir / "summary.json").read_text())
    wall = json.loads(ft("status", run_id, "--json", runs_dir=run_dir.parent).stdout)["timeline"]["wall_s"]
    # A timing, not asserted (benchmarks/receipts.py has the ratio): rank 0's receipt work against the
    # run's wall clock from its first start.
    print(f"{run_id}: evaluation {timing['eval_seconds']} s, registry and receipt {timing['publish_seconds']} s, "
          f"receipt work {timing['receipt_seconds']} s of the run's {wall} s")


def test_a_run_that_does_not_beat_its_base_stays_a_draft_and_is_never_promoted(lab, tmp_path):
    recipe = tiny_recipe()
    recipe["name"] = f"tiny-draft-{secrets.token_hex(4)}"  # a name of its own: no earlier session's versions
    recipe["training"] |= {"steps": 4, "learning_rate": 1e-7, "warmup_steps": 0}
    recipe["checkpoint"] |= {"every_steps": 4}
    path = tmp_path / "draft.yaml"
    path.write_text(yaml.safe_dump(recipe))
    runs = lab_runs(lab, "draft")
    run = submit(path, runs_dir=runs)
    assert wait_done(run["run_id"], runs_dir=runs) == "COMPLETED"
    results = json.loads((runs / run["run_id"] / "eval.json").read_text())
    assert results["state"] == "draft" and results["why"].startswith("failed held_out_loss_drop"), results
    assert results["registry"]["state"] == "draft"
    listed = json.loads(ft("adapters", "ls", "--name", recipe["name"], "--json").stdout)
    assert [(v["id"], v["state"]) for v in listed] == [(results["registry"]["version"], "draft")]
    refused = ft("adapters", "promote", results["registry"]["version"])
    assert refused.returncode == 2 and "never promoted" in refused.stderr and "held_out_loss_drop" in refused.stderr
    status = ft("status", run["run_id"], runs_dir=runs)
    assert "eval: draft: failed held_out_loss_drop" in status.stdout


def copy_of(run_dir: Path, folder: Path) -> Path:
    """The run's folder copied under another runs root (the same run id and owner): tampered there,
    never in the run other tests read."""
    copy = folder / "runs" / run_dir.name
    shutil.copytree(run_dir, copy, symlinks=True, ignore=shutil.ignore_patterns("wandb", "ranks", "launch"))
    return copy


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_any_changed_byte_of_an_entry_or_an_artifact_fails_verify_and_is_named(lab, tiny_baseline, tmp_path):
    from toolkit.cluster.profile import load_profile

    signing = load_profile("lab").receipts
    assert signing is not None, "the lab's profile names no receipt signer (ansible/roles/ft_signer)"
    run_dir = Path(tiny_baseline["run_dir"])
    pristine = copy_of(run_dir, tmp_path / "pristine")
    assert verify(pristine, signing).verified

    receipt_bytes = (pristine / "receipt.jsonl").read_bytes()
    lines = receipt_bytes.splitlines(keepends=True)
    for at in range(0, len(receipt_bytes), max(len(receipt_bytes) // 300, 1)):  # bytes all over every entry
        if receipt_bytes[at:at + 1] == b"\n":
            continue
        flip(pristine / "receipt.jsonl", at)
        verdict = verify(pristine, signing)
        flip(pristine / "receipt.jsonl", at)
        line = receipt_bytes[:at].count(b"\n") + 1
        assert not verdict.verified, f"byte {at} (line {line}) changed, and the receipt still verifies"
        named = [finding for finding in verdict.findings if f"at line {line}" in finding.where
                 or finding.where in (f"line {line}", "signature") or finding.where.startswith(f"entry {line} ")]
        assert named, (at, verdict.findings)

    cases = {
        "adapter weights": lambda copy: flip(copy / "output" / "adapter_model.safetensors", 4096),
        "evaluation": lambda copy: flip(copy / "eval.json", 10),
        "checkpoint manifest": lambda copy: flip(next((copy / "checkpoints").glob("step-*/manifest.json")), 5),
        "job script": lambda copy: flip(copy / "job.sbatch", 20),
        "removed entry": lambda copy: (copy / "receipt.jsonl").write_bytes(b"".join(lines[:2] + lines[3:])),
        "reordered entries": lambda copy: (copy / "receipt.jsonl").write_bytes(
            b"".join(lines[:2] + [lines[3], lines[2]] + lines[4:])),
        "signature": lambda copy: flip(copy / "receipt.sig", 40),
    }
    named = {"adapter weights": "artifact 'output'", "evaluation": "artifact 'evaluation'",
             "checkpoint manifest": "artifact 'manifest'", "job script": "artifact 'job_script'",
             "removed entry": "entry 3", "reordered entries": "entry ", "signature": "signature"}
    for case, tamper in cases.items():
        copy = copy_of(run_dir, tmp_path / case.replace(" ", "-"))
        tamper(copy)
        shown = ft("receipt", "verify", run_dir.name, runs_dir=copy.parent)
        assert shown.returncode == FAILED_EXIT, f"{case}: {shown.stdout}{shown.stderr}"
        assert named[case] in shown.stdout, f"{case}: {shown.stdout}"


def test_a_plain_job_naming_a_run_gets_no_made_up_receipt_signed(lab, tmp_path):
    """The review's attack on the lab's real signer and Slurm: a `sleep` job whose comment names a run,
    and a receipt made up for it (a 70B base model, an evaluation of 0.99) recording ft's job script.
    Slurm's copy of the job's batch script is the `sleep`: nothing is signed, and no ledger file left."""
    import subprocess
    import uuid

    from tests.support.slurm import cancel, job_fields, wait_for
    from toolkit.cluster.profile import load_profile
    from toolkit.receipts.chain import Receipt, ReceiptError

    signing = load_profile("lab").receipts
    run_id = f"made-up-{uuid.uuid4().hex[:8]}"
    run_dir = lab_runs(lab, "receipts") / run_id
    run_dir.mkdir()
    (run_dir / "job.sbatch").write_text(f"#!/bin/bash\n# ft job script: run {run_id} of recipe x on cluster lab.\n"
                                        "exec python3 -m toolkit.job\n")
    receipt = Receipt(run_dir)
    receipt.append("submit", {"run_id": run_id, "model": "llama-70b"}, {"job_script": run_dir / "job.sbatch"})
    receipt.append("adapter", {"evaluation": 0.99})
    partition = os.environ.get("FT_TEST_PARTITION", "standard")
    job = subprocess.run(["sbatch", "--parsable", f"--partition={partition}", f"--comment=ft-run={run_id}",
                          "--output=/dev/null", "--wrap=sleep 300"], capture_output=True, text=True, cwd="/tmp",
                         timeout=60, check=True).stdout.strip().split(";")[0]
    try:
        wait_for(f"job {job} to start", lambda: job_fields(job).get("JobState") == "RUNNING", timeout=60)
        with pytest.raises(ReceiptError, match="is not the job script the receipt's first entry records"):
            receipt.seal(signing.socket)
    finally:
        cancel(job)
    assert not (run_dir / "receipt.sig").exists()
    if signing.ledger:
        assert not (Path(signing.ledger) / str(os.getuid()) / f"{run_id}.jsonl").exists()
