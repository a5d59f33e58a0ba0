"""Rank 0's uploader: each published checkpoint goes to the object store while training goes on.

Object-store trouble never stops training: a failed upload is retried with backoff (1 s, doubling
to a minute) for as long as the run lives, and a newer checkpoint published meanwhile takes the
place of the one waiting (only the newest is worth uploading). Its progress and its lag are on the
status board (`ft status`). At the end of a run the job waits a bounded time for the last upload;
an upload abandoned then, or by a killed job, has no manifest and is never taken for a checkpoint,
and its unfinished multipart uploads are aborted (now, or by the next mirror of the prefix).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from toolkit.checkpoint.manifest import Manifest
from toolkit.checkpoint.remote import RemoteProblem, RemoteTier
from toolkit.checkpoint.shared import SharedTier
from toolkit.checkpoint.status import StatusBoard
from toolkit.storage.object_store import within

FIRST_BACKOFF_S, MAX_BACKOFF_S = 1.0, 60.0


class Mirror:
    def __init__(self, remote: RemoteTier, shared: SharedTier, board: StatusBoard, log: Callable[[str], None],
                 max_backoff: float = MAX_BACKOFF_S, before_file: Callable[[], None] = lambda: None):
        self.remote, self.shared, self.board, self.log = remote, shared, board, log
        self.before_file = before_file  # a hook for injected faults (toolkit/train/faults.py)
        self.max_backoff = max_backoff
        self.condition = threading.Condition()
        self.wanted: Manifest | None = None  # the newest published checkpoint not uploaded yet
        self.uploading: Manifest | None = None
        self.closing = False
        self.failing: str | None = None  # why the last attempt failed; None once one succeeds
        self.failures = 0
        self.hurry = False  # the run is ending: retry at once, no backoff
        self.uploads = 0
        self.thread = threading.Thread(target=self._run, name="ft-checkpoint-mirror", daemon=True)

    def start(self, newest: Manifest | None) -> None:
        """Start uploading; `newest` (the newest checkpoint on the shared filesystem) is uploaded
        first unless the store has it already: a mirror that fell behind before a restart catches up."""
        self.wanted = newest
        self.thread.start()

    def offer(self, published: Manifest) -> None:
        with self.condition:
            self.wanted = published
            self.condition.notify_all()
        self.board.pending(published.step)

    def drain(self, timeout: float) -> bool:
        """Wait until every published checkpoint is uploaded; False when `timeout` ran out first, or
        as soon as an attempt made meanwhile fails (a store that is down is not waited for)."""
        deadline = time.monotonic() + timeout
        with self.condition:
            failures = self.failures
            while self.wanted is not None or self.uploading is not None:
                left = deadline - time.monotonic()
                if left <= 0 or self.failures > failures:
                    return False
                self.condition.wait(left)
        return True

    def close(self, timeout: float) -> bool:
        """The end of this process's uploads: one more attempt at once if the store was failing, a
        wait of up to `timeout` for the last upload, else it is abandoned and its unfinished multipart
        uploads aborted. True when nothing was abandoned."""
        with self.condition:
            self.hurry = True
            self.condition.notify_all()  # cuts a backoff short
        drained = self.drain(timeout)
        with self.condition:
            self.closing = True
            in_flight, abandoned = self.uploading, self.uploading or self.wanted
            self.condition.notify_all()
        if not drained and abandoned is not None:
            self.board.gave_up(abandoned.step)
            why = f"the store is failing: {self.failing}" if self.failing else f"not within {timeout:.0f} s"
            self.log(f"warning: checkpoint step {abandoned.step} did not reach {self.remote} ({why}): its upload "
                     "is abandoned (the shared filesystem has it; a restart's mirror uploads it)")
            if in_flight is not None:  # best effort: the next start's mirror aborts what is left
                within(self.remote.abort_unfinished, 15)
        return drained

    def _keep_going(self) -> bool:
        # Only the end of the run stops an upload half-way: one replaced by every newer checkpoint would
        # never finish when saves come faster than uploads.
        self.before_file()
        return not self.closing

    def _run(self) -> None:
        backoff = FIRST_BACKOFF_S
        first = True
        while True:
            with self.condition:
                while self.wanted is None and not self.closing:
                    self.condition.wait()
                if self.closing:
                    return
                self.uploading, self.wanted = self.wanted, None
            try:
                if first:
                    aborted = self.remote.abort_unfinished()
                    if aborted:
                        self.log(f"aborted {aborted} unfinished upload(s) a previous job left in {self.remote}")
                    first = False
                self._upload(self.uploading)
                self.failing, backoff = None, FIRST_BACKOFF_S
            except InterruptedError:
                pass  # a newer checkpoint, or the end of the run: the loop decides
            except Exception as exc:  # noqa: BLE001 - the store's trouble, whatever its kind: retried, never raised
                self._failed(exc, backoff)
                backoff = min(backoff * 2, self.max_backoff)
            finally:
                with self.condition:
                    self.uploading = None
                    self.condition.notify_all()

    def _upload(self, checkpoint: Manifest) -> None:
        try:
            if self.remote.manifest(checkpoint.tag) == checkpoint:
                self.board.mirrored(checkpoint.step)
                return  # uploaded before this process started
        except RemoteProblem:
            pass
        started = time.monotonic()
        self.board.pending(checkpoint.step)
        self.shared.pinned.add(checkpoint.tag)  # not pruned while it goes up
        try:
            self.remote.upload(self.shared.root / checkpoint.tag, checkpoint, self._keep_going)
        except FileNotFoundError:
            if self.wanted is not None:  # pruned or replaced meanwhile: a newer one is waiting
                raise InterruptedError(f"checkpoint {checkpoint.tag} was superseded") from None
            raise
        finally:
            self.shared.pinned.discard(checkpoint.tag)
        seconds = time.monotonic() - started
        self.remote.prune()
        self.board.mirrored(checkpoint.step)
        self.uploads += 1
        self.log(f"checkpoint step {checkpoint.step} mirrored to {self.remote} in {seconds:.1f} s "
                 f"({checkpoint.total_bytes / max(seconds, 1e-6) / 1e6:.0f} MB/s)")

    def _failed(self, exc: Exception, backoff: float) -> None:
        checkpoint = self.uploading
        message = f"{type(exc).__name__}: {exc}"
        self.failing = message
        self.board.failed(message)
        self.log(f"warning: mirroring checkpoint step {checkpoint.step} to {self.remote} failed ({message}); "
                 f"retrying in {backoff:.0f} s")
        with self.condition:
            if self.wanted is None:
                self.wanted = checkpoint  # retried, unless a newer one came meanwhile
            self.failures += 1
            self.condition.notify_all()  # a drain gives up on a failing store at once
            if not self.hurry:
                self.condition.wait(backoff)
