"""Where a run's checkpoints are, tier by tier, for `ft status`: written by rank 0 as they move
(checkpoints.json in the run directory), read on the login node. No torch here."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from pathlib import Path


class StatusBoard:
    """Rank 0's record of its checkpoint tiers. Both background threads (the shared write, the
    upload) report here; every change rewrites the file whole."""

    def __init__(self, path: Path | None, remote_url: str | None):
        self.path = path
        self.lock = threading.Lock()
        self.state: dict = {"shared": {"step": None, "at": None},
                            "remote": {"url": remote_url, "step": None, "at": None, "pending": None,
                                       "error": None, "failing_since": None, "retrying": False,
                                       "abandoned": None, "behind_since": None} if remote_url else None}
        self.unmirrored: dict[int, float] = {}  # shared checkpoints not in the mirror yet: step -> published at
        self.carry_over()

    def carry_over(self) -> None:
        """The steps an earlier start of the run recorded: its first writes here must not say "no
        checkpoint" of a run that has them (the job script counts node losses by that step)."""
        try:
            earlier = json.loads(self.path.read_text()) if self.path is not None else None
        except (OSError, ValueError, RecursionError):
            return
        for tier in ("shared", "remote"):
            found = earlier.get(tier) if isinstance(earlier, dict) else None
            mine = self.state.get(tier)
            if isinstance(found, dict) and mine is not None and type(found.get("step")) is int and \
                    (tier == "shared" or found.get("url") == mine["url"]):
                mine["step"] = found["step"]
                mine["at"] = found.get("at") if isinstance(found.get("at"), (int, float)) else None
                if tier == "remote" and isinstance(found.get("behind_since"), (int, float)):
                    mine["behind_since"] = found["behind_since"]  # the mirror was behind before this start

    def _update(self, tier: str, **values) -> None:
        from toolkit.base.shared_dirs import write_atomically

        with self.lock:
            if self.state.get(tier) is None:
                return
            self.state[tier].update(values)
            text = json.dumps(self.state, indent=1) + "\n"
            if self.path is not None:
                with contextlib.suppress(OSError):  # a status line is never worth stopping a save for
                    write_atomically(self.path, text)

    def published(self, step: int) -> None:
        now = time.time()
        self._update("shared", step=step, at=now)
        remote = self.state.get("remote")
        if remote is not None and (remote.get("step") is None or remote["step"] < step):
            self.unmirrored[step] = now
            if remote.get("behind_since") is None:
                self._update("remote", behind_since=now)

    def pending(self, step: int) -> None:
        self._update("remote", pending=step)

    def mirrored(self, step: int) -> None:
        """`behind_since`: when the oldest shared checkpoint the mirror still lacks was published
        (None when it has the newest). The upload lag is counted from it: not reset by each new
        save while uploads fail or fall further behind."""
        pending = (self.state.get("remote") or {}).get("pending")
        self.unmirrored = {s: at for s, at in self.unmirrored.items() if s > step}
        self._update("remote", step=step, at=time.time(), error=None, failing_since=None, retrying=False,
                     pending=None if pending is not None and pending <= step else pending,
                     behind_since=min(self.unmirrored.values(), default=None))

    def failed(self, error: str) -> None:
        since = (self.state.get("remote") or {}).get("failing_since") or time.time()
        self._update("remote", error=error[:500], failing_since=since, retrying=True)

    def gave_up(self, step: int) -> None:
        """The process ends with this checkpoint not uploaded: nothing retries it any more (a
        restart's mirror will)."""
        self._update("remote", abandoned=step, pending=None, retrying=False)


def summary_line(state: dict, now: float | None = None) -> str | None:
    """One line for `ft status`: the newest checkpoint in each tier and how far the mirror lags (None
    before the first checkpoint, or for a file that is not what rank 0 writes)."""
    try:
        return _summary(state, time.time() if now is None else now)
    except (AttributeError, TypeError, ValueError, KeyError, OverflowError):
        return None


def _summary(state: dict, now: float) -> str | None:
    shared = state.get("shared") or {}
    if shared.get("step") is None:
        return None
    parts = [f"step {shared['step']} on the shared filesystem"]
    remote = state.get("remote")
    if remote:
        step = remote.get("step")
        where = f"in {remote.get('url')}"
        parts.append(f"step {step} {where}" if step is not None else f"none yet {where}")
        if remote.get("pending") is not None and remote.get("pending") != step:
            parts.append(f"uploading step {remote['pending']}")
        if remote.get("abandoned") is not None:
            why = f": {remote['error']}" if remote.get("error") else ""
            parts.append(f"step {remote['abandoned']} was not uploaded when the job ended{why}")
        elif remote.get("error") and remote.get("retrying", True):
            since = now - float(remote.get("failing_since") or now)
            parts.append(f"failing for {since:.0f} s, retrying: {remote['error']}")
    return "; ".join(parts)
