"""The signer's ledger (toolkit/services/signer.py): what it signed for a run before rides in every
later signature, so a user who rewrites an entry and has the chain signed again (a later job of theirs
may carry the run's name in its comment: Slurm lets anyone set their job's comment) still fails
`ft receipt verify`. A fake squeue stands in for Slurm (tests/support/receipts.py says why)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from tests.support.receipts import FakeSqueue, record_a_run, running_signer, site_key
from toolkit.receipts import keys
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
    signing = signing.model_copy(update={"ledger": str(ledger)})  # where verify reads what was signed
    with running_signer(private, Path(signing.socket), FakeSqueue({}), ledger=ledger):
        receipt = record_a_run(run_dir, data)
        receipt.seal(signing.socket)  # the run's own job, at its end
        yield receipt, signing, private


def test_an_entry_rewritten_and_signed_again_is_still_caught(signed_run):
    receipt, signing, _ = signed_run
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
    receipt, signing, _ = signed_run
    original = receipt.path.read_bytes().splitlines(keepends=True)
    receipt.path.write_bytes(b"".join(original[:5]))
    with pytest.raises(ReceiptError, match="had 7 entries signed before"):
        receipt.seal(signing.socket)


def test_an_untouched_receipt_sealed_at_each_attempt_verifies(signed_run):
    receipt, signing, _ = signed_run
    receipt.append("attempt", {"job_id": "100", "start": 2})
    receipt.seal(signing.socket)
    verdict = verify(receipt.layout.root, signing)
    assert verdict.findings == [] and verdict.signed["history"] == [[7, verdict.signed["history"][0][1]]]


def test_the_same_count_with_other_entries_is_refused_and_caught(signed_run):
    """Rewritten to as many entries as were signed: the signer refuses; and a signature carrying that
    history got anyway (two nodes' signers racing, say) still fails verify."""
    receipt, signing, private = signed_run
    first = json.loads(receipt.layout.receipt_signature.read_text())["payload"]
    original = receipt.path.read_bytes().splitlines(keepends=True)
    receipt.path.write_bytes(b"".join(original[:5]))
    receipt.append("adapter", {"method": "lora", "forged": True}, {"adapter": receipt.layout.root / "output"})
    receipt.append("eval", {"loss": 0.0001}, {"results": receipt.layout.root / "eval.json"})  # 7 again
    with pytest.raises(ReceiptError, match="signed entries never change"):
        receipt.seal(signing.socket)
    head = json.loads(receipt.path.read_bytes().splitlines()[-1])["hash"]
    payload = first | {"head": head, "history": [[7, first["head"]]]}
    receipt.layout.receipt_signature.write_text(json.dumps(
        {"payload": payload, "signature": base64.b64encode(private.sign(keys.signed_message(payload))).decode()}))
    found = [str(finding) for finding in verify(receipt.layout.root, signing).findings]
    assert any(f.startswith("entry 7 (eval): is not the entry signed (its hash is not the head signed when")
               for f in found), found


def test_a_signature_asked_by_a_job_that_ran_none_of_the_attempts_fails(tmp_path):
    """Another job of the same user, its comment naming the run: the signer signs (Slurm says it is the
    user's job of that run) but the receipt's attempts name the job that ran it."""
    private, signing = site_key(tmp_path / "site")
    data = tmp_path / "train.jsonl"
    data.write_text("{}\n")
    run_dir = tmp_path / "runs" / "run-1"
    run_dir.mkdir(parents=True)
    with running_signer(private, Path(signing.socket), FakeSqueue({"job_id": 777})):
        receipt = record_a_run(run_dir, data)  # its attempts: job 100
        receipt.seal(signing.socket)
    found = [str(finding) for finding in verify(run_dir, signing).findings]
    assert found == ["signature: signed for job 777, which ran none of the receipt's attempts (jobs 100)"]


def test_a_later_job_of_the_same_user_naming_the_run_gets_nothing_signed(signed_run, tmp_path):
    receipt, signing, private = signed_run
    other = tmp_path / "other.sock"
    with running_signer(private, other, FakeSqueue({"job_id": 777}), ledger=Path(signing.ledger)):
        receipt.append("attempt", {"job": "777"})
        with pytest.raises(ReceiptError, match="is job 100's, which Slurm no longer runs"):
            receipt.seal(other)


def test_a_receipt_cut_back_to_an_earlier_seal_with_that_seals_signature_is_found(signed_run):
    receipt, signing, _ = signed_run
    kept_receipt, kept_signature = receipt.path.read_bytes(), receipt.layout.receipt_signature.read_bytes()
    receipt.append("attempt_end", {"job": "100", "class": "user error"})
    receipt.append("attempt", {"job": "100", "start": 2})
    receipt.seal(signing.socket)
    receipt.path.write_bytes(kept_receipt)  # the user error and what followed, cut away
    receipt.layout.receipt_signature.write_bytes(kept_signature)
    found = [str(finding) for finding in verify(receipt.layout.root, signing).findings]
    assert found == ["signature: signs 7 entries, but 9 were signed before: entries were removed and the rest "
                     "signed again"]


def test_a_ledger_that_cannot_be_read_whole_signs_nothing(signed_run):
    receipt, signing, _ = signed_run
    (ledger_file,) = Path(signing.ledger).glob("*/run-1.jsonl")
    with open(ledger_file, "ab") as handle:
        handle.write(b'{"entries": 9, "hea')  # a write cut short
    receipt.append("attempt", {"job": "100", "start": 2})
    with pytest.raises(ReceiptError, match="has a line that is not a point"):
        receipt.seal(signing.socket)
