"""The launcher's log line: what each node's launcher, its workers' supervisor and the requeue path
print, stamped with the node and the time (the run's node-<host>.log)."""

from __future__ import annotations

import socket
import time


def log(message: str) -> None:
    print(f"[ft-launch {socket.gethostname()} {time.strftime('%H:%M:%S')}] {message}", flush=True)
