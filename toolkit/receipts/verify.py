"""Whether a run's receipt holds (`ft receipt verify RUN`): every entry as written (its hash), in its
place (seq and the link to the entry before: a changed, removed, inserted or reordered entry is
named), signed by the site's key over exactly this chain (the signed count and last hash: entries
added or removed after signing), for the run folder's owner, and every recorded file as it was
then (bytes and sha256). An unsigned receipt does not verify: it is said, not passed.

Each problem is a Finding: where ("entry 5 (checkpoint)", "signature", "receipt") and what.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from toolkit.base.digests import public_key_bytes
from toolkit.base.shared_dirs import open_regular, user_name
from toolkit.checkpoint.manifest import safe_name
from toolkit.receipts.chain import (
    GENESIS,
    SHA256_PATTERN,
    ReceiptError,
    canonical,
    entry_hash,
    file_digest,
    folder_files,
    parse_entry,
    read_receipt,
)
from toolkit.receipts.keys import verify_signature
from toolkit.receipts.ledger import LEDGER_MAX_BYTES, Ledger
from toolkit.receipts.signing import REPLY_MAX_BYTES
from toolkit.receipts.site import ReceiptSigning
from toolkit.runs.layout import RunLayout

FAILED_EXIT = 3  # `ft receipt verify`'s exit when the receipt does not verify (2: usage, 1: ft could not check)
MAX_SIGNATURE_BYTES = REPLY_MAX_BYTES + 1  # the signer's reply as it came, and its newline
MAX_FILES_ADDED = 100  # files found in a recorded folder beyond its record, named one by one
PAYLOAD_KEYS = {"run_id", "entries", "head", "uid", "user", "job_id", "signed_at", "key_id", "history",
                "first", "job_script", "checked"}
# What signers wrote before they checked the job's batch script: still read, said to vouch for less.
PAYLOAD_KEYS_UNCHECKED = PAYLOAD_KEYS - {"first", "job_script", "checked"}


@dataclass(frozen=True)
class Finding:
    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


@dataclass
class Verdict:
    run_dir: Path
    entries: int = 0
    signed: dict | None = None  # the payload, once its signature holds with the site's key
    vouched: dict | None = None  # which entries the signer checked, which are the user's word
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def verified(self) -> bool:
        return not self.findings

    def to_dict(self) -> dict:
        return {"run_id": self.run_dir.name, "run_dir": str(self.run_dir), "verified": self.verified,
                "entries": self.entries, "signed": self.signed, "vouched": self.vouched,
                "findings": [asdict(finding) for finding in self.findings], "notes": self.notes}


def verify(run_dir: Path, signing: ReceiptSigning | None) -> Verdict:
    """Check the receipt of the run in `run_dir` against the site's signer key (None: the cluster
    has no signer)."""
    verdict = Verdict(run_dir)
    layout = RunLayout(run_dir)
    lines = receipt_lines(layout.receipt, verdict)
    entries = check_entries(lines, verdict)
    verdict.entries = len(lines)
    check_signature(layout, len(lines), entries, signing, verdict)
    check_artifacts(run_dir, entries, verdict)
    return verdict


def label(entry: dict, line: int) -> str:
    """How a finding names an entry: by its seq and kind, and its line where that is not its seq."""
    return f"entry {entry['seq']} ({entry['kind'][:40]})" + (f" at line {line}" if line != entry["seq"] else "")


def receipt_lines(path: Path, verdict: Verdict) -> list[bytes]:
    """The receipt's lines; a last line cut short (no line end) is a finding, not an entry."""
    try:
        data = read_receipt(path)
    except FileNotFoundError:
        verdict.findings.append(Finding("receipt", f"{path} does not exist: the run recorded nothing"))
        return []
    except (OSError, ReceiptError) as exc:
        verdict.findings.append(Finding("receipt", f"{path} cannot be read: {exc}"))
        return []
    if not data:
        verdict.findings.append(Finding("receipt", f"{path} is empty"))
    lines = data.split(b"\n")
    if lines[-1]:
        verdict.findings.append(Finding(f"line {len(lines)}", "cut short (no line end): the receipt was truncated"))
    return lines[:-1]


def check_entries(lines: list[bytes], verdict: Verdict) -> list[tuple[int, dict]]:
    """Each line's entry as written (hash, canonical form) and in its place; the entries that parse,
    with their line numbers."""
    entries: list[tuple[int, dict]] = []
    seen: set[int] = set()
    for number, line in enumerate(lines, 1):
        try:
            entry = parse_entry(line)
        except ValueError as exc:
            verdict.findings.append(Finding(f"line {number}", str(exc)))
            continue
        if entry_hash(entry) != entry["hash"]:
            verdict.findings.append(Finding(label(entry, number), "changed: its content does not match its hash"))
        elif not written_as(entry, line):
            verdict.findings.append(Finding(label(entry, number), "changed: the line is not as ft wrote it"))
        place = misplaced(entry, entries[-1][1] if entries else None, seen)
        if place:
            verdict.findings.append(Finding(label(entry, number), place))
        seen.add(entry["seq"])
        entries.append((number, entry))
    verdict.findings += gaps(seen)
    return entries


def gaps(seen: set[int]) -> list[Finding]:
    """The entries no line holds, one finding a run of them (a seq far out costs no more)."""
    found, expected = [], 1
    for seq in sorted(seen):
        if seq > expected:
            which = f"entry {expected}" if seq == expected + 1 else f"entries {expected} to {seq - 1}"
            found.append(Finding(which, "missing: removed from the receipt"))
        expected = max(expected, seq + 1)
    return found


def written_as(entry: dict, line: bytes) -> bool:
    try:
        return canonical(entry) == line
    except ValueError:  # NaN or Infinity: never written by ft
        return False


def misplaced(entry: dict, before: dict | None, seen: set[int]) -> str | None:
    """Why an entry is not where the chain puts it (after `before`), or None."""
    seq, last = entry["seq"], before["seq"] if before else 0
    if seq in seen:
        return "appears more than once: an entry was inserted or copied"
    if seq < last:
        return f"out of order: found after entry {last}"
    if seq > last + 1:
        return None  # the entries between are missing: said once each, below
    if entry["prev"] != (before["hash"] if before else GENESIS):
        return f"does not link to the entry before it ({f'entry {last}' if before else 'the start'}): " \
               "an entry was changed, inserted or reordered"
    return None


def check_signature(layout: RunLayout, count: int, entries: list[tuple[int, dict]], signing: ReceiptSigning | None,
                    verdict: Verdict) -> None:
    try:
        with open_regular(layout.receipt_signature) as handle:
            raw = handle.read(MAX_SIGNATURE_BYTES + 1)
    except FileNotFoundError:
        why = ("this cluster has no receipt signer (its profile has no receipts section)" if signing is None
               else "it was never sealed, or its signature was removed")
        verdict.findings.append(Finding("signature", f"the receipt is not signed: {why}"))
        return
    except OSError as exc:
        verdict.findings.append(Finding("signature", f"{layout.receipt_signature} cannot be read: {exc}"))
        return
    payload, signature = parse_signature(raw)
    if payload is None:
        verdict.findings.append(Finding("signature", f"{layout.receipt_signature} is not a signature ft wrote"))
        return
    if signing is None:
        verdict.findings.append(Finding("signature", "cannot be checked: this cluster's profile names no signer key "
                                                     "(receipts.public_key)"))
        return
    if payload["key_id"] != signing.key_id:
        verdict.findings.append(Finding("signature", f"made with key {str(payload['key_id'])[:40]!r}, not this "
                                                     f"site's key {signing.key_id}"))
        return
    if not verify_signature(public_key_bytes(signing.public_key), payload, signature):
        verdict.findings.append(Finding("signature", "does not verify with the site's key: the signature or what "
                                                     "it signs was changed, or another key made it"))
        return
    verdict.signed = payload
    check_signed_chain(layout, payload, count, entries, verdict, ledger_points(signing, layout))
    check_vouched(payload, count, entries, verdict)


def check_vouched(payload: dict, count: int, entries: list[tuple[int, dict]], verdict: Verdict) -> None:
    """What the signer checked against Slurm (the job, and entry 1's job script: the batch script
    Slurm ran), and what is the user's own word (every later entry: written by the job's processes,
    which run as the user): said in the verdict, and the first entry must be the one checked."""
    if "first" not in payload:
        verdict.vouched = {"checked": [], "users_word": f"entries 1-{count}" if count else "none",
                           "says": "signed before the signer checked job scripts: Slurm ran a job of this run for "
                                   "its user; what the receipt records is the job's own word"}
        return
    by_seq = {entry["seq"]: entry for _, entry in entries}
    first = by_seq.get(1)
    if first is None or first["hash"] != payload["first"]:
        verdict.findings.append(Finding("entry 1 (submit)", "is not the first entry the signer checked: it was "
                                                            "changed or replaced after signing"))
    recorded = ((first or {}).get("artifacts") or {}).get("job_script") if isinstance(first, dict) else None
    if not isinstance(recorded, dict) or recorded.get("sha256") != payload["job_script"]:
        verdict.findings.append(Finding("entry 1 (submit)", "does not record the job script the signer checked"))
    later = f"entries 2-{count}" if count > 2 else "entry 2" if count == 2 else "none"
    verdict.vouched = {"checked": [1], "users_word": later,
                       "says": f"checked by the site's signer against Slurm: job {payload['job_id']} ran for "
                               f"{payload['user']}, and its batch script is entry 1's job script, of ft's shape "
                               f"(sha256 {str(payload['job_script'])[:12]}); {later}: written by the job's "
                               "processes, the user's own word"}


def parse_signature(raw: bytes) -> tuple[dict | None, str]:
    try:
        document = json.loads(raw) if len(raw) <= MAX_SIGNATURE_BYTES else None
    except (ValueError, RecursionError):
        return None, ""
    if not isinstance(document, dict) or not isinstance(document.get("signature"), str):
        return None, ""
    payload = document.get("payload")
    if not isinstance(payload, dict) or set(payload) not in (PAYLOAD_KEYS, PAYLOAD_KEYS_UNCHECKED) \
            or not history_points(payload["history"]):
        return None, ""
    return payload, document["signature"]


def history_points(history: object) -> bool:
    """Whether a payload's history is what the signer writes: [[entries, head], ...]."""
    return isinstance(history, list) and all(
        isinstance(point, list) and len(point) == 2 and type(point[0]) is int and isinstance(point[1], str)
        for point in history)


def ledger_points(signing: ReceiptSigning, layout: RunLayout) -> list[list]:
    """What the signers signed for this run (their ledger, where the profile names it and it is
    readable here): [[entries, head], ...]; [] where not known."""
    if not signing.ledger:
        return []
    try:
        owner = os.stat(layout.root).st_uid
        with open_regular(Ledger(Path(signing.ledger)).path(owner, layout.root.name)) as handle:
            text = handle.read(LEDGER_MAX_BYTES + 1)
    except OSError:
        return []
    points = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError, TypeError, KeyError, RecursionError):
            points.append(list(Ledger.point(line)[:2]))
    return points


def check_signed_chain(layout: RunLayout, payload: dict, count: int, entries: list[tuple[int, dict]],
                       verdict: Verdict, ledger: list[list] = ()) -> None:
    """What was signed is this run's chain as it is now, for the run folder's owner."""
    signed = payload["entries"]
    if payload["run_id"] != layout.root.name:
        verdict.findings.append(Finding("signature", f"signs run {str(payload['run_id'])[:120]!r}, not "
                                                     f"{layout.root.name}"))
    if count > signed:
        added = f"entry {count}" if count == signed + 1 else f"entries {signed + 1} to {count}"
        verdict.findings.append(Finding("signature", f"signs {signed} entries; {added} added after signing"))
    elif count < signed:
        verdict.findings.append(Finding("signature", f"signs {signed} entries; the receipt has {count}: entries "
                                                     "were removed after signing"))
    # The points the signer signed before (its ledger's), each checked on its own: an entry changed
    # since then, the chain signed again by a later job of the same user, is still found (a point of
    # the same count as the signed one, with another head, too).
    by_seq = {entry["seq"]: (line, entry) for line, entry in entries}
    checked = []
    for point in [*payload["history"], *ledger, [signed, payload["head"]]]:
        if point not in checked:
            checked.append(point)
    for points, head in checked:
        if points > signed:
            verdict.findings.append(Finding("signature", f"signs {signed} entries, but {points} were signed before: "
                                                         "entries were removed and the rest signed again"))
        elif points in by_seq and by_seq[points][1]["hash"] != head:
            line, entry = by_seq[points]
            when = "signed head" if head == payload["head"] and points == signed else \
                f"head signed when the receipt had {points} entries"
            verdict.findings.append(Finding(label(entry, line), f"is not the entry signed (its hash is not the "
                                                                f"{when}): it was changed after it was signed"))
    # The job that asked for the signature ran this run: an attempt entry names it (a job of the
    # same user whose comment names the run, but which never ran it, signs nothing of its).
    ran = {str(entry["body"].get("job")) for _, entry in entries
           if entry["kind"] == "attempt" and isinstance(entry.get("body"), dict) and entry["body"].get("job")}
    if ran and str(payload["job_id"]) not in ran:
        verdict.findings.append(Finding("signature", f"signed for job {str(payload['job_id'])[:20]}, which ran none "
                                                     f"of the receipt's attempts (jobs {', '.join(sorted(ran))})"))
    submitted = [entry for _, entry in entries if entry["kind"] == "submit" and isinstance(entry.get("body"), dict)]
    named = submitted[0]["body"].get("run_id") if submitted else None
    if named not in (None, layout.root.name):
        verdict.findings.append(Finding("entry 1 (submit)",
                                        f"records run {str(named)[:120]!r}, not {layout.root.name}"))
    try:
        owner = os.stat(layout.root).st_uid
    except OSError as exc:
        verdict.findings.append(Finding("receipt", f"the run folder cannot be read: {exc}"))
        return
    if payload["uid"] != owner:
        uid = payload["uid"] if type(payload["uid"]) is int else -1
        verdict.findings.append(Finding("signature", f"signed for {user_name(uid)}; the run folder is "
                                                     f"{user_name(owner)}'s"))


def check_artifacts(run_dir: Path, entries: list[tuple[int, dict]], verdict: Verdict) -> None:
    """Every recorded file as it was recorded: each read once, however many entries record it."""
    digests: dict[Path, tuple[int, str] | OSError] = {}

    def now(path: Path) -> tuple[int, str] | OSError:
        if path not in digests:
            try:
                digests[path] = file_digest(path)
            except OSError as exc:
                digests[path] = exc
        return digests[path]

    unread = foreign_reader(run_dir)
    for line, entry in entries:
        for name, artifact in sorted(entry["artifacts"].items()):
            where = f"{label(entry, line)}, artifact {str(name)[:80]!r}"
            if gone_as_allowed(run_dir, artifact):
                verdict.notes.append(f"{where}: {artifact['path']} is gone (recorded as one that may be pruned)")
                continue
            notes: list[str] = []
            verdict.findings += [Finding(where, problem)
                                 for problem in artifact_problems(run_dir, artifact, now, unread, notes)]
            verdict.notes += [f"{where}: {note}" for note in notes]


def foreign_reader(run_dir: Path):
    """Where the verifier is not the run's owner (root, a reviewer): why a path is not read, or None.
    A path that leads out of the run folder (itself, through a symlink, or through a folder artifact's
    file names) is read only when the owner owns what it leads to. A receipt is the owner's word:
    naming /etc/shadow, or a folder of /root, would otherwise have root's verify tell its size, its
    digest or whether it exists. The owner's own verify reads what the owner may read."""
    try:
        owner = os.stat(run_dir).st_uid
    except OSError:
        return lambda path: None
    if os.geteuid() == owner:
        return lambda path: None
    inside = os.path.realpath(run_dir)

    def reason(path: Path) -> str | None:
        real = os.path.realpath(path)
        if real == inside or real.startswith(inside + os.sep):
            return None
        try:
            if os.stat(real).st_uid == owner:
                return None
        except OSError:
            pass  # what does not exist outside the run is not said either: no oracle
        return (f"{path} leads outside the run folder to a file not {user_name(owner)}'s: not read by another "
                f"user's verify (run `ft receipt verify` as {user_name(owner)} to check it)")
    return reason


def recorded_at(run_dir: Path, path: str) -> Path:
    return Path(path) if os.path.isabs(path) else run_dir / path


def gone_as_allowed(run_dir: Path, artifact: object) -> bool:
    """A file recorded as prunable (an older checkpoint's manifest) that is no longer there."""
    return isinstance(artifact, dict) and artifact.get("prunable") is True and isinstance(artifact.get("path"), str) \
        and not os.path.lexists(recorded_at(run_dir, artifact["path"]))


def artifact_problems(run_dir: Path, artifact: object, now, unread, notes: list[str]) -> list[str]:
    if not isinstance(artifact, dict) or not isinstance(artifact.get("path"), str):
        return ["not an artifact record"]
    path = recorded_at(run_dir, artifact["path"])
    if isinstance(artifact.get("files"), dict):
        return folder_problems(path, artifact["files"], now, unread, notes)
    return file_problems(path, artifact, now, unread, notes)


def file_problems(path: Path, recorded: object, now, unread, notes: list[str]) -> list[str]:
    if not isinstance(recorded, dict) or type(recorded.get("bytes")) is not int \
            or not SHA256_PATTERN.fullmatch(str(recorded.get("sha256"))):
        return [f"{path}: not a file's record (bytes, sha256)"]
    if Path(os.path.realpath(path)).parts[1:2] in (("proc",), ("sys",), ("dev",)):
        return [f"{path} is no file ft records (a receipt naming /proc/kcore would keep a verifier reading)"]
    why = unread(path)
    if why:
        notes.append(why)
        return []
    try:
        size = os.stat(path).st_size
    except FileNotFoundError:
        return [f"missing: {path}"]
    except OSError as exc:
        return [f"{path} cannot be read: {exc}"]
    if size != recorded["bytes"]:  # changed, whatever its digest: not read
        return [f"changed: {path} is {size} bytes; recorded {recorded['bytes']} bytes"]
    found = now(path)
    if isinstance(found, OSError):
        return [f"{path} cannot be read: {found}"]
    size, sha256 = found
    if (size, sha256) != (recorded["bytes"], recorded["sha256"]):
        return [f"changed: {path} is {size} bytes, sha256 {sha256[:16]}…; recorded {recorded['bytes']} bytes, "
                f"sha256 {recorded['sha256'][:16]}…"]
    return []


def folder_problems(folder: Path, files: dict, now, unread, notes: list[str]) -> list[str]:
    why = unread(folder)
    if why:
        notes.append(why)
        return []
    if not folder.is_dir():
        return [f"missing: {folder}"]
    problems = []
    for name, recorded in sorted(files.items()):
        if not safe_name(str(name)):  # ft records a folder's files by their names in it, nothing else
            problems.append(f"{folder}: {str(name)[:200]!r} is no file name ft records (a path of its own)")
            continue
        problems += file_problems(folder / str(name), recorded, now, unread, notes)
    try:  # listed only so far: a receipt naming / as a folder never has the verifier walk every disk
        present = folder_files(folder, limit=len(files) + MAX_FILES_ADDED)
    except OSError as exc:
        return [*problems, f"{folder} cannot be listed: {exc}"]
    added = sorted(set(present) - set(files))
    problems += [f"changed: {folder / name} was not there when recorded" for name in added[:MAX_FILES_ADDED]]
    if len(added) > MAX_FILES_ADDED:
        problems.append(f"changed: {folder} holds more than {MAX_FILES_ADDED} files that were not there when recorded")
    return problems
