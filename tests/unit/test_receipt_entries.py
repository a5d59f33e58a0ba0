"""What a run records in its receipt and where (toolkit/receipts/entries.py): the submit entry, and
entries inside the job that never stop training."""

from __future__ import annotations

import json
from pathlib import Path

from toolkit.receipts import entries
from toolkit.receipts.chain import Digest, Receipt
from toolkit.recipe.resolve import resolve

REPO = Path(__file__).resolve().parents[2]


def test_the_submit_entry_names_the_run_its_data_recipe_script_and_image(tmp_path):
    resolved = resolve(REPO / "recipes" / "tiny-lora-sft.yaml", "lab")
    resolved.profile = resolved.profile.model_copy(
        update={"container_image": "registry.example/ft@sha256:" + "ab" * 32, "container_runtime": "pyxis"})
    run_dir = tmp_path / "run-1"
    run_dir.mkdir()
    (run_dir / "recipe.resolved.yaml").write_text("name: tiny\n")
    (run_dir / "job.sbatch").write_text("#!/bin/bash\n")
    data = Path(resolved.recipe.data.train)
    digests = {"train": Digest(data, data.stat().st_size, "cd" * 32), "golden": "ef" * 32}
    entries.submitted(run_dir, resolved, digests)
    (entry,) = [json.loads(line) for line in (run_dir / "receipt.jsonl").read_text().splitlines()]
    assert entry["kind"] == "submit" and entry["body"]["run_id"] == "run-1"
    assert entry["body"]["data"] == {"train": "cd" * 32, "golden": "ef" * 32}
    assert entry["body"]["container_digest"] == "sha256:" + "ab" * 32
    assert set(entry["artifacts"]) == {"recipe", "job_script", "data.train"}
    assert entry["artifacts"]["data.train"]["path"] == str(data)  # outside the run: absolute


def test_inside_the_job_a_receipt_that_cannot_be_written_never_stops_training(tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run-1"
    run_dir.mkdir()
    (run_dir / "receipt.jsonl").write_text('{"torn": ')  # a damaged last line: no append
    entries.attempt(run_dir, 1, ["node1"], [])
    assert "the receipt's attempt entry was not written" in capsys.readouterr().err
    assert entries.spent_seconds > 0


def test_a_signer_that_does_not_answer_is_asked_again_then_the_receipt_stays_unsigned(tmp_path, capsys,
                                                                                       monkeypatch):
    run_dir = tmp_path / "run-1"
    run_dir.mkdir()
    receipt = Receipt(run_dir)
    receipt.append("attempt", {"job": "7"})
    asked = []
    original = receipt.seal

    def seal(socket_path):
        asked.append(socket_path)
        return original(socket_path, timeout=1)

    monkeypatch.setattr(receipt, "seal", seal)
    entries.sealed(receipt, str(tmp_path / "none.sock"), pause=0)
    assert len(asked) == entries.SEAL_TRIES and not receipt.layout.receipt_signature.exists()
    assert "the receipt was not signed" in capsys.readouterr().err
    entries.sealed(receipt, "", pause=0)  # no signer on this cluster: nothing asked, nothing said
    assert len(asked) == entries.SEAL_TRIES and capsys.readouterr().err == ""


def test_the_runs_end_completes_its_receipt_whatever_the_registry_does(tmp_path, monkeypatch):
    """A full disk or a stale handle in the registry (an OSError, not ft's own error) never fails the
    run at its very end: the adapter entry is written all the same."""
    from tests.support.run_specs import run_spec
    from toolkit.runs.layout import RunLayout
    from toolkit.train import publish

    run_dir = tmp_path / "run-1"
    (run_dir / "output").mkdir(parents=True)
    (run_dir / "output" / "adapter_config.json").write_text("{}")

    def failing(*_):
        raise OSError(116, "Stale file handle")

    monkeypatch.setattr(publish, "register", failing)
    said = []
    publish.publish(RunLayout(run_dir), run_spec().recipe, {"state": "promoted"}, 10, said.append)
    (entry,) = [json.loads(line) for line in (run_dir / "receipt.jsonl").read_text().splitlines()]
    assert entry["kind"] == "adapter" and "output" in entry["artifacts"]
    assert "did not complete: [Errno 116] Stale file handle" in said[0]
