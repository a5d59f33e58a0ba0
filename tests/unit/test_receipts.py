"""Run receipts: the chain as several processes build it, sealed by a real signer on a temporary
socket (Slurm's answer is a fake squeue: tests/support/receipts.py), and every kind of tampering
`ft receipt verify` must name."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.receipts import FakeSqueue, record_a_run, running_signer, site_key
from toolkit.receipts.chain import Digest, Receipt, ReceiptError, canonical, entry_hash
from toolkit.receipts.verify import FAILED_EXIT, verify


@pytest.fixture
def site(tmp_path):
    private, signing = site_key(tmp_path / "site")
    squeue = FakeSqueue({})
    with running_signer(private, Path(signing.socket), squeue):
        yield signing


@pytest.fixture
def run(tmp_path, site):
    """A sealed run: its folder, its receipt, the data file it trained on (outside the run)."""
    data = tmp_path / "data" / "train.jsonl"
    data.parent.mkdir()
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    run_dir = tmp_path / "runs" / "run-1"
    run_dir.mkdir(parents=True)
    receipt = record_a_run(run_dir, data)
    receipt.seal(site.socket)
    return receipt


def findings(receipt: Receipt, signing) -> list[str]:
    return [str(finding) for finding in verify(receipt.layout.root, signing).findings]


def lines(receipt: Receipt) -> list[bytes]:
    return receipt.path.read_bytes().splitlines(keepends=True)


def test_a_sealed_run_verifies_with_every_entry_linked(run, site):
    verdict = verify(run.layout.root, site)
    assert verdict.findings == [] and verdict.verified
    assert verdict.entries == 7 and verdict.signed["entries"] == 7 and verdict.signed["job_id"] == "100"
    entries = [json.loads(line) for line in lines(run)]
    assert [entry["seq"] for entry in entries] == list(range(1, 8))
    assert all(entry["prev"] == before["hash"] for before, entry in zip(entries, entries[1:], strict=False))
    assert all(entry["hash"] == entry_hash(entry) for entry in entries)
    adapter = entries[5]["artifacts"]["adapter"]
    assert adapter["path"] == "output" and sorted(adapter["files"]) == ["adapter_config.json",
                                                                        "adapter_model.safetensors"]
    assert entries[0]["artifacts"]["data"]["path"].startswith("/")  # outside the run: absolute


def test_every_single_byte_changed_in_an_entry_is_named(run, site):
    original = lines(run)
    target = original[2]  # entry 3, an attempt
    for offset in range(len(target)):
        changed = bytearray(target)
        changed[offset] ^= 0x01
        run.path.write_bytes(b"".join(original[:2]) + bytes(changed) + b"".join(original[3:]))
        found = findings(run, site)
        assert any(f.startswith(("entry 3 ", "line 3:")) or " at line 3" in f.split(":")[0] for f in found), \
            (offset, found)


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_an_entry_holding_nan_or_infinity_is_named_not_a_crash(run, site, constant):
    original = lines(run)
    entry = json.loads(original[2])
    entry["time"] = 0.0  # a number ft wrote, replaced by what Python's json reads but JSON has not
    changed = json.dumps(entry).encode().replace(b'"time": 0.0', b'"time": ' + constant) + b"\n"
    run.path.write_bytes(b"".join(original[:2]) + changed + b"".join(original[3:]))
    assert f"line 3: not JSON ({constant.decode().replace('1e999', 'inf')} is not JSON)" in findings(run, site)


@pytest.mark.parametrize("artifact", ["data", "recipe", "manifest", "adapter", "results"])
def test_one_changed_byte_in_any_recorded_file_is_named_with_its_entry(run, site, tmp_path, artifact):
    path = {"data": tmp_path / "data" / "train.jsonl", "recipe": run.layout.recipe_resolved,
            "manifest": run.layout.checkpoints / "step-00000020" / "manifest.json",
            "adapter": run.layout.output / "adapter_model.safetensors",
            "results": run.layout.root / "eval.json"}[artifact]
    original = path.read_bytes()
    for offset in (0, len(original) // 2, len(original) - 1):
        changed = bytearray(original)
        changed[offset] ^= 0x01
        path.write_bytes(bytes(changed))
        found = findings(run, site)
        assert len(found) == 1 and f"artifact {artifact!r}: changed: {path}" in found[0], found
    path.write_bytes(original)
    assert findings(run, site) == []


def test_a_removed_entry_is_named(run, site):
    original = lines(run)
    run.path.write_bytes(b"".join(original[:3] + original[4:]))
    found = findings(run, site)
    assert "entry 4: missing: removed from the receipt" in found
    assert "signature: signs 7 entries; the receipt has 6: entries were removed after signing" in found


def test_removed_entries_are_named_as_one_span_however_far_a_seq_reaches(run, site):
    original = lines(run)
    run.path.write_bytes(b"".join(original[:1] + original[4:]))
    assert "entries 2 to 4: missing: removed from the receipt" in findings(run, site)
    forged = json.loads(original[1]) | {"seq": 10**15}
    run.path.write_bytes(b"".join(original) + json.dumps(forged).encode() + b"\n")
    assert "entries 8 to 999999999999999: missing: removed from the receipt" in findings(run, site)


def test_a_reordered_pair_is_named(run, site):
    original = lines(run)
    run.path.write_bytes(b"".join(original[:3] + [original[4], original[3]] + original[5:]))
    assert "entry 4 (checkpoint) at line 5: out of order: found after entry 5" in findings(run, site)


def test_an_entry_appended_after_signing_is_named(run, site):
    run.append("eval", {"loss": 0.1})
    assert findings(run, site) == ["signature: signs 7 entries; entry 8 added after signing"]


def test_entries_rewritten_after_signing_do_not_match_the_signed_head(run, site):
    """Someone who rebuilds the chain from entry 7 on (every hash right) still changes the signed head."""
    original = lines(run)
    run.path.write_bytes(b"".join(original[:6]))
    run.append("eval", {"loss": 0.0001}, {"results": run.layout.root / "eval.json"})
    found = findings(run, site)
    assert any(f.startswith("entry 7 (eval): is not the entry signed") for f in found), found


def test_a_truncated_receipt_is_named(run, site):
    data = run.path.read_bytes()
    run.path.write_bytes(data[:-40])  # into the last entry
    found = findings(run, site)
    assert "line 7: cut short (no line end): the receipt was truncated" in found
    assert "signature: signs 7 entries; the receipt has 6: entries were removed after signing" in found


def test_a_signature_by_another_key_fails(run, site, tmp_path):
    other_private, other = site_key(tmp_path / "other")
    with running_signer(other_private, Path(other.socket), FakeSqueue({})):
        run.seal(other.socket)
    assert findings(run, site) == [f"signature: made with key '{other.key_id}', not this site's key {site.key_id}"]
    signed = json.loads(run.layout.receipt_signature.read_text())
    signed["payload"]["key_id"] = site.key_id  # another key's signature passed off as the site's
    run.layout.receipt_signature.write_text(json.dumps(signed))
    assert findings(run, site) == ["signature: does not verify with the site's key: the signature or what it signs "
                                   "was changed, or another key made it"]


def test_a_changed_signed_payload_fails(run, site):
    signed = json.loads(run.layout.receipt_signature.read_text())
    signed["payload"]["entries"] = 8
    run.layout.receipt_signature.write_text(json.dumps(signed))
    assert findings(run, site)[0].startswith("signature: does not verify with the site's key")


def test_a_missing_signature_is_not_a_pass(run, site):
    run.layout.receipt_signature.unlink()
    verdict = verify(run.layout.root, site)
    assert not verdict.verified
    assert [str(f) for f in verdict.findings] == ["signature: the receipt is not signed: it was never sealed, or its "
                                                  "signature was removed"]
    assert [str(f) for f in verify(run.layout.root, None).findings] == [
        "signature: the receipt is not signed: this cluster has no receipt signer (its profile has no receipts "
        "section)"]


@pytest.mark.skipif(os.geteuid() != 0, reason="gives the run folder to another user (needs root)")
def test_a_signature_for_another_user_than_the_folder_s_owner_fails(run, site):
    os.chown(run.layout.root, 65534, -1)
    try:
        assert any(f.startswith("signature: signed for user root (uid 0); the run folder is")
                   for f in findings(run, site))
    finally:
        os.chown(run.layout.root, 0, -1)


@pytest.mark.skipif(os.geteuid() != 0, reason="gives the run folder to another user (needs root)")
def test_another_users_verify_reads_no_file_outside_the_run_that_is_not_the_owners(run, site, monkeypatch):
    """The receipt is its owner's word: root's verify of it reads what lies outside the run folder
    only where the owner owns it (the data file here is root's: a receipt naming /etc/shadow)."""
    from toolkit.receipts import verify as verifying

    data = [json.loads(line) for line in lines(run)][0]["artifacts"]["data"]["path"]
    read: list[str] = []
    real = verifying.file_digest
    monkeypatch.setattr(verifying, "file_digest", lambda path: read.append(str(path)) or real(path))
    os.chown(run.layout.root, 65534, -1)
    try:
        verdict = verify(run.layout.root, site)
    finally:
        os.chown(run.layout.root, 0, -1)
    assert data not in read and read  # the run's own files are read, the outside one is not
    nobody = verifying.user_name(65534)
    expected = (f"{data} leads outside the run folder to a file not {nobody}'s: not read by another user's verify "
                f"(run `ft receipt verify` as {nobody} to check it)")
    assert any(note.endswith(expected) for note in verdict.notes)
    assert not any(data in finding.what for finding in verdict.findings)
    read.clear()
    assert verify(run.layout.root, site).verified and data in read  # the owner's own verify reads it


@pytest.mark.skipif(os.geteuid() != 0, reason="gives the run folder to another user (needs root)")
def test_another_users_verify_follows_neither_a_folders_file_names_nor_links_out_of_the_run(tmp_path, monkeypatch):
    from toolkit.receipts import verify as verifying

    run_dir = tmp_path / "runs" / "run-x"
    (run_dir / "ck").mkdir(parents=True)
    secret = tmp_path / "secret"
    secret.write_text("root's own\n")  # root's, as /etc/shadow is
    (run_dir / "ck" / "a").symlink_to(secret)
    from toolkit.receipts.chain import GENESIS

    zero = {"bytes": 1, "sha256": "0" * 64}
    entry = {"seq": 1, "kind": "checkpoint", "time": 1.0, "body": {}, "prev": GENESIS,
             "artifacts": {"ck": {"path": "ck", "files": {"a": zero, str(secret): zero, "../../secret": zero}}}}
    entry["hash"] = entry_hash(entry)
    (run_dir / "receipt.jsonl").write_bytes(canonical(entry) + b"\n")  # as written by hand: the owner's word
    read: list[str] = []
    real = verifying.file_digest
    monkeypatch.setattr(verifying, "file_digest", lambda path: read.append(str(path)) or real(path))
    os.chown(run_dir, 65534, -1)
    verdict = verify(run_dir, None)
    said = " ".join([*map(str, verdict.findings), *verdict.notes])
    assert read == [] and "root's own" not in said and " is 11 bytes" not in said
    assert f"{run_dir / 'ck' / 'a'} leads outside the run folder" in said
    assert f"{str(secret)!r} is no file name ft records" in said and "'../../secret' is no file name" in said


def test_a_pruned_checkpoint_is_a_note_and_a_removed_adapter_a_finding(run, site):
    (run.layout.checkpoints / "step-00000010" / "manifest.json").unlink()
    verdict = verify(run.layout.root, site)
    assert verdict.verified
    assert verdict.notes == ["entry 4 (checkpoint), artifact 'manifest': checkpoints/step-00000010/manifest.json is "
                             "gone (recorded as one that may be pruned)"]
    (run.layout.output / "adapter_config.json").unlink()
    (run.layout.output / "extra.bin").write_bytes(b"x")
    assert findings(run, site) == [
        f"entry 6 (adapter), artifact 'adapter': missing: {run.layout.output / 'adapter_config.json'}",
        f"entry 6 (adapter), artifact 'adapter': changed: {run.layout.output / 'extra.bin'} was not there when "
        "recorded"]


def test_a_known_digest_is_recorded_without_reading_the_file(tmp_path):
    receipt = Receipt(tmp_path)
    entry = receipt.append("submit", {}, {"data": Digest(Path("/nowhere/data.jsonl"), 12, "a" * 64)})
    assert entry["artifacts"]["data"] == {"path": "/nowhere/data.jsonl", "bytes": 12, "sha256": "a" * 64}
    with pytest.raises(ReceiptError, match="sha256"):
        receipt.append("submit", {}, {"data": Digest(Path("/x"), 1, "not hex")})


def _append_many(run_dir: str, writer: int, count: int) -> None:
    receipt = Receipt(Path(run_dir))
    for index in range(count):
        receipt.append("attempt", {"writer": writer, "index": index})


def test_concurrent_appends_from_several_processes_keep_one_linear_chain(tmp_path):
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_append_many, args=(str(tmp_path), writer, 40)) for writer in range(6)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(120)
        assert process.exitcode == 0
    verdict = verify(tmp_path, None)
    assert verdict.entries == 240
    assert [str(f) for f in verdict.findings] == ["signature: the receipt is not signed: this cluster has no receipt "
                                                  "signer (its profile has no receipts section)"]
    entries = [json.loads(line) for line in Receipt(tmp_path).path.read_bytes().splitlines()]
    for writer in range(6):  # each writer's entries in its own order
        assert [e["body"]["index"] for e in entries if e["body"]["writer"] == writer] == list(range(40))


def test_reading_a_hostile_receipt_is_bounded(tmp_path):
    layout = Receipt(tmp_path).layout
    os.mkfifo(layout.receipt)  # a reader that opened it as a file would wait for good
    assert "is not a regular file" in str(verify(tmp_path, None).findings[0])
    with pytest.raises(ReceiptError):
        Receipt(tmp_path).append("submit", {})
    layout.receipt.unlink()
    layout.receipt.write_bytes(b"[" * 100_000 + b"\n" + b"x" * (2 << 20) + b"\n")
    assert [str(f) for f in verify(tmp_path, None).findings][:2] == [
        "line 1: nested too deeply: not an entry ft writes", "line 2: over 1048576 bytes: not an entry ft writes"]


def test_a_receipt_naming_a_pseudo_file_is_not_read_for_ever(tmp_path):
    """The chain's hashes are no secret: anyone can write a well-linked entry. A verifier (root, say)
    never reads /proc/kcore for it, nor a file whose size already says it changed."""
    receipt = Receipt(tmp_path)
    receipt.append("eval", {}, {"kcore": Digest(Path("/proc/kcore"), 1 << 47, "a" * 64),
                                "zero": Digest(Path("/dev/zero"), 1, "a" * 64)})
    (tmp_path / "big").write_bytes(b"x" * 10)
    receipt.append("eval", {}, {"big": Digest(tmp_path / "big", 1 << 40, "a" * 64)})
    found = [str(f) for f in verify(tmp_path, None).findings]
    assert found[1:] == [
        "entry 1 (eval), artifact 'kcore': /proc/kcore is no file ft records (a receipt naming /proc/kcore would "
        "keep a verifier reading)",
        "entry 1 (eval), artifact 'zero': /dev/zero is no file ft records (a receipt naming /proc/kcore would keep a "
        "verifier reading)",
        f"entry 2 (eval), artifact 'big': changed: {tmp_path / 'big'} is 10 bytes; recorded {1 << 40} bytes"]
    entry = {"seq": 3, "kind": "adapter", "time": 1.0, "body": {}, "artifacts": {"all": {"path": "/", "files": {}}},
             "prev": json.loads(receipt.path.read_bytes().splitlines()[-1])["hash"]}
    with open(receipt.path, "ab") as handle:
        handle.write(canonical(entry | {"hash": entry_hash(entry)}) + b"\n")
    assert [str(f) for f in verify(tmp_path, None).findings][-1] == \
        "entry 3 (adapter), artifact 'all': changed: / holds more than 100 files that were not there when recorded"


def test_an_append_after_a_damaged_last_line_is_refused(tmp_path):
    receipt = Receipt(tmp_path)
    receipt.append("submit", {})
    with open(receipt.path, "ab") as handle:
        handle.write(b'{"seq": 2')  # a write cut short
    with pytest.raises(ReceiptError, match="ends in a cut or overlong line"):
        receipt.append("attempt", {})


def test_a_body_that_is_not_plain_json_is_refused(tmp_path):
    with pytest.raises(ReceiptError, match="not plain JSON"):
        Receipt(tmp_path).append("eval", {"loss": float("nan")})
    with pytest.raises(ReceiptError, match="not an entry kind"):
        Receipt(tmp_path).append("Bad Kind", {})
    assert not Receipt(tmp_path).path.exists()


def ft(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_ft_receipt_verify_and_show_exit_codes(run, site, tmp_path):
    profile = tmp_path / "cluster.yaml"
    profile.write_text(json.dumps({"name": "lab", "receipts": site.model_dump()}))
    env = {"FT_RUNS_DIR": str(run.layout.root.parent), "FT_SITE_PROFILE": str(profile)}
    verified = ft("receipt", "verify", "run-1", "--json", env=env)
    assert verified.returncode == 0, verified.stderr
    assert json.loads(verified.stdout)["verified"] is True
    shown = json.loads(ft("receipt", "show", "run-1", "--json", env=env).stdout)
    assert [entry["kind"] for entry in shown["entries"]] == ["submit", "attempt", "attempt", "checkpoint",
                                                             "checkpoint", "adapter", "eval"]
    assert shown["signature"]["payload"]["entries"] == 7
    (run.layout.root / "eval.json").write_text('{"loss": 0.5}')
    failed = ft("receipt", "verify", "run-1", env=env)
    assert failed.returncode == FAILED_EXIT == 3
    assert "NOT verified (1 finding)" in failed.stdout
    assert "entry 7 (eval), artifact 'results': changed" in failed.stdout
    assert ft("receipt", "verify", "no-such-run", env=env).returncode == 2
    assert ft("receipt", "verify", "../etc", env=env).returncode == 2


def test_the_profile_s_receipts_section_is_checked(site, tmp_path, monkeypatch):
    from toolkit.cluster.profile import ProfileError, load_profile

    profile = tmp_path / "cluster.yaml"
    monkeypatch.setenv("FT_SITE_PROFILE", str(profile))
    profile.write_text(json.dumps({"name": "lab", "receipts": site.model_dump()}))
    assert load_profile("lab").receipts == site
    for change, error in [({"key_id": "0" * 16}, "is not this public key's"), ({"public_key": "AAAA"}, "32 bytes"),
                          ({"public_key": "not base64!"}, "is not base64"), ({"socket": "signer.sock"}, "absolute"),
                          ({"port": 1}, "Extra inputs")]:
        profile.write_text(json.dumps({"name": "lab", "receipts": site.model_dump() | change}))
        with pytest.raises(ProfileError, match=error):
            load_profile("lab")


def test_verify_says_which_entries_the_signer_checked_and_which_are_the_users_word(run, site):
    verdict = verify(run.layout.root, site)
    assert verdict.verified and verdict.vouched["checked"] == [1] and verdict.vouched["users_word"] == "entries 2-7"
    assert "its batch script is entry 1's job script" in verdict.vouched["says"]
    assert verdict.to_dict()["vouched"] == verdict.vouched  # `ft receipt verify --json` prints it


def test_a_first_entry_rewritten_after_signing_is_named(run, site, tmp_path):
    """Entry 1 replaced by one recording another job script, the chain rebuilt from it: the signature's
    first entry is not it."""
    entries = [json.loads(line) for line in lines(run)]
    entries[0]["artifacts"]["job_script"]["sha256"] = "0" * 64
    previous = "0" * 64
    for entry in entries:
        entry["prev"] = previous
        entry["hash"] = entry_hash(entry)
        previous = entry["hash"]
    run.path.write_bytes(b"".join(canonical(entry) + b"\n" for entry in entries))
    found = findings(run, site)
    assert "entry 1 (submit): is not the first entry the signer checked: it was changed or replaced after signing" \
        in found
    assert "entry 1 (submit): does not record the job script the signer checked" in found
