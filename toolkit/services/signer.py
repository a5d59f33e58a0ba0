"""The site's receipt signer: a small daemon on each compute node (ansible/roles/ft_signer starts it)
that signs a run's receipt for the run's own job, and for nobody else.

    python -m toolkit.services.signer --key /etc/ft/signing/receipt.key \\
        --socket /run/ft-signer/receipt.sock --user ft-signer

It starts as root, loads the key (only its user reads it), binds a Unix socket every user may
connect to, and becomes --user for good. A client sends one JSON line, {run_id, entries, head, first}
(its receipt's entry count, last hash, and first entry: `ft submit`'s, which records the job script),
and gets one back: {payload, signature}, or {error}. It signs

    {run_id, entries, head, uid, user, job_id, signed_at, key_id, history, first, job_script, checked}

for the client the kernel names (SO_PEERCRED: its uid, not anything it says) only while Slurm runs a
job of that user whose comment names that run (`squeue --all --json`; the job's user is Slurm's
word), and only when that job's batch script, as Slurm holds it (`scontrol write batch_script`: the
signer's account is a Slurm operator), is the job script the first entry records, and has ft's
shape for that run (toolkit/services/run_targets.script_problem): a job that runs anything else (a
`sleep` with a made-up receipt) gets nothing signed. (A script of ft's shape written by hand still
passes: the signer vouches for what Slurm ran, not for who rendered it.) One job signs one run: its
script's header names the run, and a job's script never changes (a job whose comment is changed to
name other runs gets none of them signed). `first` is that entry's hash, `job_script` the script's
sha256, and `checked` the entries the signer could check ([1]); every later entry is written by the
job's own processes, the user's word, which `ft receipt verify` says.
`history` is every (entries, head) it signed for that user's run before, from its ledger (--ledger:
a folder on the shared filesystem only the signer writes, one file per user and run, so every
node's signer knows them): a receipt whose entries were changed after they were signed fails
`ft receipt verify` whichever job asked for the new signature (a later job of the same user may
carry the run's name in its comment: Slurm lets anyone set their job's comment). A request for fewer
entries than were signed before is refused.
Each client has CLIENT_TIMEOUT_S and REQUEST_MAX_BYTES; at most MAX_CLIENTS are served at once
(more are turned away), and at most MAX_PER_USER of one user; whatever one client sends costs only
its own request.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import os
import signal
import socket
import socketserver
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from toolkit.base.errors import FtError
from toolkit.base.names import RUN_ID_PATTERN
from toolkit.base.privileges import drop_privileges
from toolkit.base.shared_dirs import login_name
from toolkit.receipts import keys
from toolkit.receipts.canonical import canonical
from toolkit.receipts.chain import ENTRY_KEYS, GENESIS, SHA256_PATTERN, entry_hash
from toolkit.receipts.ledger import Ledger, Refused
from toolkit.receipts.signing import read_line
from toolkit.services import run_targets
from toolkit.slurm import commands, jobs

REQUEST_MAX_BYTES = 64 << 10  # the first entry: the submit's recipe, job script and data digests
CLIENT_TIMEOUT_S = 5.0  # for the whole request: a client that trickles bytes is cut off
MAX_CLIENTS = 64
MAX_PER_USER = 4  # a user's jobs seal at a start's end and at the run's end: a few at once at most
SQUEUE_TIMEOUT_S = 10.0
PEERCRED = struct.Struct("3i")  # pid, uid, gid


@dataclass(frozen=True)
class Request:
    run_id: str
    entries: int
    head: str
    first: str  # the first entry's hash
    job_script: str  # the sha256 of the job script it records


def parse_request(data: bytes) -> Request:
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):
        raise Refused("the request is not one JSON line") from None
    if not isinstance(raw, dict) or set(raw) != {"run_id", "entries", "head", "first"}:
        raise Refused("the request is not {run_id, entries, head, first}")
    run_id, entries, head = raw["run_id"], raw["entries"], raw["head"]
    if not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id):
        raise Refused("run_id is not a run id")
    if type(entries) is not int or not 0 < entries < 1 << 40:
        raise Refused("entries is not a count of entries")
    if not isinstance(head, str) or not SHA256_PATTERN.fullmatch(head):
        raise Refused("head is not a sha256 in lowercase hex")
    first, job_script = submit_entry(raw["first"], run_id)
    return Request(run_id, entries, head, first, job_script)


def submit_entry(entry: object, run_id: str) -> tuple[str, str]:
    """The first entry's hash and the job script's sha256 it records; Refused unless it is the entry
    `ft submit` writes for this run (its hash its own: it is checked as it is linked, by verify)."""
    if not isinstance(entry, dict) or set(entry) != ENTRY_KEYS:
        raise Refused("first is not a receipt entry")
    if entry["seq"] != 1 or entry["kind"] != "submit" or entry["prev"] != GENESIS:
        raise Refused("first is not the receipt's first entry (seq 1, kind submit)")
    try:
        own_hash = entry_hash(entry)
    except (TypeError, ValueError):
        raise Refused("first is not plain JSON") from None
    if entry["hash"] != own_hash:
        raise Refused("first's hash is not its own")
    body, artifacts = entry["body"], entry["artifacts"]
    if not isinstance(body, dict) or body.get("run_id") != run_id:
        raise Refused(f"first records another run than {run_id}")
    script = artifacts.get("job_script") if isinstance(artifacts, dict) else None
    if not isinstance(script, dict) or not isinstance(script.get("sha256"), str) \
            or not SHA256_PATTERN.fullmatch(script["sha256"]):
        raise Refused("first records no job script")
    return own_hash, script["sha256"]


def peer_uid(connection: socket.socket) -> int:
    return PEERCRED.unpack(connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))[1]


class RunningJobs:
    """ft's running jobs, as Slurm says (squeue --json). Asked afresh for each request: a burst of
    requests shares one answer, begun after each of them arrived (never an older one)."""

    def __init__(self, run: Callable = commands.run):
        self.run = run  # unit tests give a fake squeue here
        self.lock = threading.Lock()
        self.asked, self.jobs = float("-inf"), {}

    def since(self, arrived: float) -> dict[str, run_targets.RunningJob]:
        with self.lock:
            if self.asked < arrived:
                started = time.monotonic()
                self.jobs, self.asked = run_targets.running_ft_jobs(self.run, timeout=SQUEUE_TIMEOUT_S), started
            return self.jobs


class Signer:
    def __init__(self, private_key, jobs: RunningJobs, now: Callable[[], float] = time.time,
                 ledger: Ledger | None = None, run: Callable = commands.run):
        self.key, self.jobs, self.now = private_key, jobs, now
        self.key_id = keys.key_id(keys.raw_public(private_key))
        self.ledger = ledger or Ledger(None)
        self.run = run  # Slurm's commands (scontrol write batch_script); a fake in unit tests

    def sign(self, request: Request, uid: int, arrived: float) -> dict:
        """The signed payload and its signature, for a client of this uid; Refused saying why not."""
        user = login_name(uid)
        if user is None:
            raise Refused(f"uid {uid} has no account here")
        running = [job for job in self.jobs.since(arrived).values() if job.run == request.run_id and job.user == user]
        if not running:
            raise Refused(f"Slurm runs no job of run {request.run_id} for {user}: a receipt is signed only while "
                          "its run's job runs")
        # Checked before the run's ledger is opened: a refused request leaves nothing behind.
        running = self.running_the_script(running, request)
        with self.ledger.points(uid, request.run_id) as (history, first_job, add):
            # A run is one job's (a requeue keeps its id): once signed for it, the receipt is signed for
            # that job alone. A later job of the same user whose comment names the run signs nothing.
            pinned = [job for job in running if first_job is None or job.job_id == first_job]
            if not pinned:
                raise Refused(f"run {request.run_id} is job {first_job}'s, which Slurm no longer runs: its receipt "
                              "is signed only while that job runs")
            job, script = min(pinned, key=lambda job: int(job.job_id)), request.job_script
            if history and request.entries < max(entries for entries, _ in history):
                raise Refused(f"run {request.run_id} had {max(e for e, _ in history)} entries signed before: "
                              f"a receipt of {request.entries} is one with entries removed")
            if any(entries == request.entries and head != request.head for entries, head in history):
                raise Refused(f"run {request.run_id} was signed with {request.entries} entries and another last "
                              "entry before: signed entries never change")
            if len(history) >= Ledger.MAX_POINTS:
                raise Refused(f"run {request.run_id} was signed {len(history)} times already")
            payload = {"run_id": request.run_id, "entries": request.entries, "head": request.head, "uid": uid,
                       "user": job.user, "job_id": job.job_id, "signed_at": self.now(), "key_id": self.key_id,
                       "history": [point for point in history if point != [request.entries, request.head]],
                       "first": request.first, "job_script": script, "checked": [1]}
            signature = base64.b64encode(self.key.sign(keys.signed_message(payload))).decode()
            if [request.entries, request.head] not in history:
                add(request.entries, request.head, job.job_id, payload["signed_at"])
        return {"payload": payload, "signature": signature}

    def running_the_script(self, running: list, request: Request) -> list:
        """The jobs among `running` whose batch script, as Slurm holds it, is the job script the
        receipt's first entry records, and ft's for this run: its header names the run, so a job signs
        one run however its comment changes (a script never changes; a job id reused after Slurm's state
        was reset is another job, with another script)."""
        matching, why = [], ""
        for job in running:
            try:
                script = jobs.batch_script(job.job_id, self.run, timeout=SQUEUE_TIMEOUT_S)
            except commands.SlurmCommandError as exc:
                raise Refused(f"Slurm would not show job {job.job_id}'s batch script ({exc.message}): ask the "
                              "admins (the signer's account is a Slurm operator: ansible/roles/ft_signer)") from None
            if hashlib.sha256(script.encode()).hexdigest() != request.job_script:
                why = why or (f"job {job.job_id}'s batch script, as Slurm holds it, is not the job script the "
                              f"receipt's first entry records (sha256 {request.job_script[:12]}): a receipt is "
                              "signed only for the job that runs it")
            elif problem := run_targets.script_problem(script, request.run_id):
                why = why or f"job {job.job_id}'s batch script is not ft's: {problem}"
            else:
                matching.append(job)
        if not matching:
            raise Refused(why)
        return matching


class Handler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        arrived = time.monotonic()
        connection, signer = self.request, self.server.signer
        uid = peer_uid(connection)
        try:
            request = parse_request(read_line(connection, REQUEST_MAX_BYTES, arrived + CLIENT_TIMEOUT_S))
            reply = signer.sign(request, uid, arrived)
            said = (f"signed run {request.run_id} ({request.entries} entries) for uid {uid}, "
                    f"job {reply['payload']['job_id']}")
        except Refused as refusal:
            reply, said = {"error": str(refusal)}, f"refused uid {uid}: {refusal}"
        except ValueError as error:
            reply, said = {"error": f"the request is {error}"}, f"refused uid {uid}: request {error}"
        except FtError as error:  # Slurm did not answer: nothing is signed on no word of Slurm's
            reply, said = {"error": f"Slurm did not answer: {error.message}"}, f"Slurm did not answer: {error.message}"
        print(said, flush=True)
        connection.settimeout(CLIENT_TIMEOUT_S)
        connection.sendall(canonical(reply) + b"\n")


class SignerServer(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    # The kernel's queue of connections not accepted yet is every user's: a user connecting in a loop
    # must not fill it for others (the per-user slots are counted once a connection is accepted).
    request_queue_size = 1024

    def __init__(self, path: Path, signer: Signer):
        self.signer = signer
        self.lock = threading.Lock()
        self.serving: dict[int, int] = {}  # uid -> its connections being served
        remove_stale_socket(path)
        super().__init__(str(path), Handler)
        os.chmod(path, 0o666)  # every user's jobs connect; who they are is the kernel's word

    def process_request(self, request, client_address) -> None:
        """At most MAX_PER_USER connections of one user at once, MAX_CLIENTS in all: a user holding
        connections open turns away their own next ones, never another user's."""
        try:
            uid = peer_uid(request)
        except OSError:
            self.shutdown_request(request)
            return
        with self.lock:
            full = self.serving.get(uid, 0) >= MAX_PER_USER or sum(self.serving.values()) >= MAX_CLIENTS
            if not full:
                self.serving[uid] = self.serving.get(uid, 0) + 1
        if full:
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, (client_address, uid))
        except BaseException:
            self.release(uid)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address[0])
        finally:
            self.release(client_address[1])

    def release(self, uid: int) -> None:
        with self.lock:
            self.serving[uid] -= 1
            if not self.serving[uid]:
                del self.serving[uid]

    def handle_error(self, request, client_address) -> None:
        print(f"a client's request failed: {sys.exc_info()[1]!r}", flush=True)


def remove_stale_socket(path: Path) -> None:
    """A socket left by an earlier signer goes; anything else there is never removed (started as root)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise SystemExit(f"{path} is there and is not a socket: not replaced")
    os.unlink(path)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolkit.services.signer",
                                     description="Sign runs' receipts for their running jobs.")
    parser.add_argument("--key", type=Path, required=True, help="the site's ed25519 key (PEM)")
    parser.add_argument("--socket", type=Path, required=True, help="the Unix socket jobs connect to")
    parser.add_argument("--user", default=None, help="started as root: become this user once listening")
    parser.add_argument("--ledger", type=Path, default=None,
                        help="a folder on the shared filesystem only the signer writes: what it signed, per run")
    options = parser.parse_args(argv)
    try:
        private_key = keys.load_private_key(options.key)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"cannot load the key {options.key}: {exc}") from None
    signer = Signer(private_key, RunningJobs(), ledger=Ledger(options.ledger))
    # One signature before root is given up: everything signing uses is loaded while ft's Python
    # can still be read (it may sit where only root reads).
    signer.key.sign(keys.signed_message({}))
    server = SignerServer(options.socket, signer)
    if options.user:
        drop_privileges(options.user)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    threading.Thread(target=server.serve_forever, name="ft-signer", daemon=True).start()
    print(f"ft receipt signer on {options.socket}, key {signer.key_id}"
          + (f", as {options.user}" if options.user else ""), flush=True)
    while not stopped.wait(1.0):
        pass
    server.shutdown()
    server.server_close()
    with contextlib.suppress(OSError):
        os.unlink(options.socket)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
