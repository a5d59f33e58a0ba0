"""The signer's ledger: the points it signed for each run, read by the signer before it signs again
and by `ft receipt verify` (a receipt cut back to an earlier seal is found there)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path

from toolkit.receipts.canonical import canonical

LEDGER_MAX_BYTES = 4 << 20


class Refused(Exception):
    """Why a request is not signed (said to the client)."""


class Ledger:
    """The points the signer signed, per user and run: <root>/<uid>/<run>.jsonl, one {entries, head,
    job_id, signed_at} per line, appended under the file's flock (signers on several nodes share it).
    World-readable: `ft receipt verify` reads a run's newest point there (a receipt cut back to an
    earlier seal, with that seal's receipt.sig, is found); only the signer writes it. No root: no
    memory (a signature carries no history)."""

    MAX_POINTS = 500  # seals of one run: each start's end and the run's end; a signature carries them all

    def __init__(self, root: Path | None):
        self.root = root

    def path(self, uid: int, run_id: str) -> Path:
        return self.root / str(uid) / f"{run_id}.jsonl"

    @staticmethod
    def point(line: bytes) -> tuple[int, str, str]:
        """One line's (entries, head, job); ValueError (or TypeError, KeyError, RecursionError) for
        anything else."""
        point = json.loads(line)
        return int(point["entries"]), str(point["head"]), str(point["job_id"])

    @contextlib.contextmanager
    def points(self, uid: int, run_id: str):
        """The run's signed points as (points [[entries, head], ...], the job that first signed, a
        function recording a new one), all under the run's lock. Refused where the ledger cannot be
        read whole: nothing is signed on a history ft cannot vouch for."""
        if self.root is None:
            yield [], None, lambda *_: None
            return
        path = self.path(uid, run_id)
        path.parent.mkdir(mode=0o755, exist_ok=True)
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
        with os.fdopen(descriptor, "r+b") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            handle.seek(0)
            text = handle.read(LEDGER_MAX_BYTES + 1)
            if len(text) > LEDGER_MAX_BYTES:
                raise Refused(f"the ledger of run {run_id} is over {LEDGER_MAX_BYTES} bytes")
            found, first_job = [], None
            for line in text.splitlines():
                try:
                    entries, head, job = self.point(line)
                except (ValueError, TypeError, KeyError, RecursionError):
                    raise Refused(f"the ledger of run {run_id} has a line that is not a point: ask the admins "
                                  "(the signer signs nothing on a history it cannot read)") from None
                first_job = first_job or job
                if [entries, head] not in found:
                    found.append([entries, head])

            def add(entries: int, head: str, job_id: str, signed_at: float) -> None:
                handle.write(canonical({"entries": entries, "head": head, "job_id": job_id,
                                        "signed_at": signed_at}) + b"\n")
                handle.flush()
                os.fsync(handle.fileno())
            yield found, first_job, add
