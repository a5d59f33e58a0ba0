"""The signer's ledger (toolkit/receipts/signer.py): what it signed for a run before rides in every
later signature, so a user who rewrites an entry and has the chain signed again (a later job of theirs
may carry the run's name in its comment: Slurm lets anyone set their job's comment) still fails
`ft receipt verify`. A fake squeue stands in for Slurm (tests/support/receipts.py says why)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.receipts import FakeSqueue, record_a_run, running_signer, site_key
from toolkit.receipts.chain import ReceiptError
from toolkit.receipts.verify import verify


@pytest.fixture
def signed_run(tmp_path):
    private, signing = site_key(tmp_path / "site")
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    run_dir = tmp_path / "runs" / "run-1"
    run_dir.mkdir(parents=True)
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    with running_signer(private, Path(signing.socket), FakeSqueue({}), ledger=ledger):
        receipt = record_a_run(run_dir, data)
        receipt.seal(signing.socket)  # the run's own job, at its end
        yield receipt, signing


def test_an_entry_rewritten_and_signed_again_is_still_caught(signed_run):
    receipt, signing = signed_run
    original = receipt.path.read_bytes().splitlines(keepends=True)
    receipt.path.write_bytes(b"".join(original[:5]))  # entries 6 and 7 rebuilt, every hash right
    receipt.append("adapter", {"method": "lora", "forged": True}, {"adapter": receipt.layout.root / "output"})
    receipt.append("eval", {"loss": 0.0001}, {"results": receipt.layout.root / "eval.json"})
    receipt.append("eval", {"loss": 0.0001})  # one more: what a new seal signs is a longer chain
    receipt.seal(signing.socket)  # a later job of the same user, its comment naming the run
    found = [str(finding) for finding in verify(receipt.layout.root, signing).findings]
    assert any(f.startswith("entry 7 (eval): is not the entry signed") and "when the receipt had 7 entries" in f
               for f in found), found


def test_a_shorter_chain_than_one_signed_before_is_never_signed(signed_run):
    receipt, signing = signed_run
    original = receipt.path.read_bytes().splitlines(keepends=True)
    receipt.path.write_bytes(b"".join(original[:5]))
    with pytest.raises(ReceiptError, match="had 7 entries signed before"):
        receipt.seal(signing.socket)


def test_an_untouched_receipt_sealed_at_each_attempt_verifies(signed_run):
    receipt, signing = signed_run
    receipt.append("attempt", {"job_id": "100", "start": 2})
    receipt.seal(signing.socket)
    verdict = verify(receipt.layout.root, signing)
    assert verdict.findings == [] and verdict.signed["history"] == [[7, verdict.signed["history"][0][1]]]
