"""The receipt signer: it signs only for a user Slurm runs a job of that run for, whoever asks; it
outlives any client; as a process it gives up root for good. Slurm's answer is a fake squeue (the
signer's query takes a runner): the lab is busy with other tests and is not this suite's to ask."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.receipts import FakeSqueue, running_signer, site_key, submit_entry
from toolkit.base.digests import key_id, public_key_bytes
from toolkit.base.shared_dirs import login_name
from toolkit.receipts.chain import ReceiptError
from toolkit.receipts.keys import verify_signature
from toolkit.receipts.signing import request_signature
from toolkit.services import signer

HEAD = "ab" * 32


def ask(socket_path: Path, run_id: str = "run-1", entries: int = 3, head: str = HEAD,
        first: dict | None = None) -> dict:
    return request_signature(socket_path, run_id, entries, head, first or submit_entry(run_id), timeout=10)


def raw_reply(socket_path: Path, data: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(10)
        connection.connect(str(socket_path))
        connection.sendall(data)
        connection.shutdown(socket.SHUT_WR)
        return connection.recv(65536)


@pytest.fixture
def key(tmp_path):
    return site_key(tmp_path)


def test_it_signs_for_the_user_slurm_runs_the_run_s_job_for(key, tmp_path):
    private, signing = key
    with running_signer(private, tmp_path / "s.sock", FakeSqueue({"job_id": 41})):
        signed = ask(tmp_path / "s.sock")
    payload = signed["payload"]
    first = submit_entry()
    assert payload | {"signed_at": 0} == {"run_id": "run-1", "entries": 3, "head": HEAD, "uid": os.getuid(),
                                          "user": login_name(os.getuid()), "job_id": "41", "signed_at": 0,
                                          "key_id": signing.key_id, "history": [], "first": first["hash"],
                                          "job_script": first["artifacts"]["job_script"]["sha256"], "checked": [1]}
    assert abs(payload["signed_at"] - time.time()) < 60
    assert verify_signature(public_key_bytes(signing.public_key), payload, signed["signature"])
    assert signing.key_id == key_id(public_key_bytes(signing.public_key))


@pytest.mark.parametrize("job, why", [
    ({"user_name": "someone-else"}, "Slurm runs no job of run run-1 for"),  # the run's job, another user's
    ({"comment": "ft-run=run-2"}, "Slurm runs no job of run run-1 for"),  # the user's job, another run's
    ({"job_state": "PENDING"}, "Slurm runs no job of run run-1 for"),  # not started, or ended
    ({"job_state": "COMPLETED"}, "Slurm runs no job of run run-1 for"),
    ({"comment": "my notes"}, "Slurm runs no job of run run-1 for"),  # not ft's
])
def test_it_refuses_a_user_without_a_running_job_of_that_run(key, tmp_path, job, why):
    with running_signer(key[0], tmp_path / "s.sock", FakeSqueue(job)), pytest.raises(ReceiptError, match=why):
        ask(tmp_path / "s.sock")


def test_what_the_client_says_of_itself_counts_for_nothing(key, tmp_path):
    """The user and job are Slurm's and the kernel's word: a request naming them is refused as malformed."""
    with running_signer(key[0], tmp_path / "s.sock", FakeSqueue({})):
        reply = raw_reply(tmp_path / "s.sock", json.dumps({"run_id": "run-1", "entries": 1, "head": HEAD,
                                                           "user": "root", "uid": 0}).encode() + b"\n")
    assert json.loads(reply) == {"error": "the request is not {run_id, entries, head, first}"}


def test_it_asks_slurm_afresh_after_each_request_arrives(key, tmp_path):
    """A job that ended a moment ago is not taken for running from an older answer."""
    squeue = FakeSqueue({})
    with running_signer(key[0], tmp_path / "s.sock", squeue):
        ask(tmp_path / "s.sock")
        squeue.text = json.dumps({"jobs": []})
        with pytest.raises(ReceiptError, match="Slurm runs no job"):
            ask(tmp_path / "s.sock")
    assert squeue.calls == 2


def test_it_signs_nothing_when_slurm_does_not_answer(key, tmp_path):
    from toolkit.slurm.commands import SlurmUnavailable

    def silent(argv, timeout):
        raise SlurmUnavailable("squeue did not answer within 10 s")

    with running_signer(key[0], tmp_path / "s.sock", silent), pytest.raises(ReceiptError, match="Slurm did not answer"):
        ask(tmp_path / "s.sock")


@pytest.mark.parametrize("request_bytes, error", [
    (b"\x00\xff garbage \n", "the request is not one JSON line"),
    (b"[" * 3000 + b"\n", "the request is not one JSON line"),
    (b"x" * 100_000, f"the request is over {64 << 10} bytes"),
    (json.dumps({"run_id": "../etc", "entries": 1, "head": HEAD, "first": {}}).encode(), "run_id is not a run id"),
    (json.dumps({"run_id": "run-1", "entries": 0, "head": HEAD, "first": {}}).encode(),
     "entries is not a count of entries"),
    (json.dumps({"run_id": "run-1", "entries": 1, "head": HEAD.upper(), "first": {}}).encode(), "head is not a sha256"),
    (json.dumps({"run_id": "run-1", "entries": 1, "head": HEAD, "first": {"seq": 1}}).encode(),
     "first is not a receipt entry"),
    (json.dumps({"run_id": "run-1", "entries": 1, "head": HEAD,
                 "first": submit_entry() | {"kind": "attempt"}}).encode(), "first is not the receipt's first entry"),
    (json.dumps({"run_id": "run-1", "entries": 1, "head": HEAD,
                 "first": submit_entry() | {"time": 5}}).encode(), "first's hash is not its own"),
    (json.dumps({"run_id": "run-1", "entries": 1, "head": HEAD,
                 "first": submit_entry("run-2")}).encode(), "first records another run than run-1"),
])
def test_it_answers_a_bad_request_and_serves_the_next_client(key, tmp_path, request_bytes, error):
    with running_signer(key[0], tmp_path / "s.sock", FakeSqueue({})):
        assert json.loads(raw_reply(tmp_path / "s.sock", request_bytes))["error"].startswith(error)
        assert ask(tmp_path / "s.sock")["payload"]["entries"] == 3


def test_it_outlives_clients_that_go_silent_or_leave(key, tmp_path, monkeypatch):
    monkeypatch.setattr(signer, "CLIENT_TIMEOUT_S", 0.5)
    with running_signer(key[0], tmp_path / "s.sock", FakeSqueue({})):
        # Within this user's slots: the silent ones, the one leaving, and the request served.
        silent = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(signer.MAX_PER_USER - 2)]
        for connection in silent:
            connection.connect(str(tmp_path / "s.sock"))  # and never a byte
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as leaving:
            leaving.connect(str(tmp_path / "s.sock"))
            leaving.sendall(b'{"run_id": "run-1", ')
        assert ask(tmp_path / "s.sock")["payload"]["run_id"] == "run-1"  # served beside the silent ones
        time.sleep(1.0)
        assert all(connection.recv(1) == b"" for connection in silent)  # cut off after the timeout
        for connection in silent:
            connection.close()
        assert ask(tmp_path / "s.sock")["payload"]["run_id"] == "run-1"


def test_no_signer_is_an_error_that_says_where_it_looked(tmp_path):
    with pytest.raises(ReceiptError, match=f"the receipt signer at {tmp_path / 'none.sock'} did not answer"):
        ask(tmp_path / "none.sock")


@pytest.mark.skipif(os.geteuid() != 0, reason="the daemon starts as root and becomes another user")
def test_the_daemon_loads_the_key_as_root_and_serves_as_another_user(key, tmp_path):
    """`python -m toolkit.services.signer` as Ansible starts it: the key readable by root alone, the
    daemon then nobody. Without squeue on its PATH it asks no Slurm (the lab's is not this test's),
    and says so to the client instead of signing."""
    key_file = tmp_path / "signing" / "receipt.key"
    assert key_file.stat().st_mode & 0o777 == 0o600 and key_file.stat().st_uid == 0
    socket_dir = tmp_path / "socket"
    socket_dir.mkdir()
    os.chown(socket_dir, 65534, -1)
    no_slurm = tmp_path / "bin"
    no_slurm.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-m", "toolkit.services.signer", "--key", str(key_file), "--socket",
         str(socket_dir / "receipt.sock"), "--user", "nobody"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PATH": str(no_slurm), "SLURM_CONF": str(tmp_path / "no-slurm.conf")})
    try:
        assert "ft receipt signer on" in process.stdout.readline()
        status = Path(f"/proc/{process.pid}/status").read_text()
        assert "\nUid:\t65534\t65534\t65534\t65534\n" in status
        assert (socket_dir / "receipt.sock").stat().st_mode & 0o777 == 0o666
        with pytest.raises(ReceiptError, match="Slurm did not answer"):
            ask(socket_dir / "receipt.sock")
        assert json.loads(raw_reply(socket_dir / "receipt.sock", b"junk\n"))["error"]
        assert process.poll() is None
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=10)
    assert process.returncode == 0


def test_the_key_is_made_once_and_never_replaced(tmp_path):
    from toolkit.receipts.keys import generate, load_private_key, raw_public

    path = tmp_path / "signing" / "receipt.key"
    assert generate(path) is True
    first = raw_public(load_private_key(path))
    assert generate(path) is False
    assert raw_public(load_private_key(path)) == first
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["receipt.key"]  # no temporary left


@pytest.mark.skipif(os.geteuid() != 0, reason="a second user's connection needs root to become that user")
def test_a_user_holding_connections_open_turns_away_only_their_own(key, tmp_path):
    """Connections held open by one user fill that user's slots, never another user's: the other
    user is still answered (here refused for having no job: answered all the same)."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="ft-signer-test-"))  # where another user reaches the socket
    folder.chmod(0o755)
    sock = folder / "s.sock"
    with running_signer(key[0], sock, FakeSqueue({"job_id": 41})):
        held = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(signer.MAX_PER_USER)]
        for connection in held:
            connection.connect(str(sock))
        time.sleep(0.2)  # the server has accepted them all
        try:
            with pytest.raises(ReceiptError, match="did not answer"):
                ask(sock)  # this user's next: turned away
            other = subprocess.run(
                [sys.executable, "-c",
                 "import os, sys; sys.path.insert(0, sys.argv[2])\n"
                 "from toolkit.receipts.signing import request_signature\n"
                 "from tests.support.receipts import submit_entry\n"
                 "os.setuid(65534)  # after the imports: ft's Python is root's to read here\n"
                 "try:\n    request_signature(sys.argv[1], 'run-1', 3, 'ab' * 32, submit_entry(), timeout=10)\n"
                 "except Exception as exc:\n    print(exc)",
                 str(sock), str(Path(__file__).resolve().parents[2])], capture_output=True, text=True, timeout=60)
            assert "refused" in other.stdout and "did not answer" not in other.stdout, other.stdout + other.stderr
        finally:
            for connection in held:
                connection.close()
        time.sleep(0.2)
        assert ask(sock)["payload"]["job_id"] == "41"  # its slots back once it let go
    shutil.rmtree(folder)


def test_a_job_whose_batch_script_is_not_the_receipts_job_script_gets_nothing_signed(key, tmp_path):
    """The review's attack: a plain `sleep` job, its comment naming the run, asking for a made-up
    receipt. Slurm's copy of its batch script is the `sleep`, not the script the receipt records."""
    squeue = FakeSqueue({"job_id": 41}, scripts={"41": "#!/bin/bash\nsleep 600\n"})
    with running_signer(key[0], tmp_path / "s.sock", squeue), \
            pytest.raises(ReceiptError, match="batch script, as Slurm holds it, is not the job script the receipt"):
        ask(tmp_path / "s.sock")


def test_slurm_refusing_the_batch_script_signs_nothing_and_names_the_fix(key, tmp_path):
    from toolkit.slurm.commands import SlurmCommandError

    squeue = FakeSqueue({"job_id": 41})

    def no_operator(argv, timeout, check=True):
        if argv[0] == "scontrol":
            raise SlurmCommandError("`scontrol write batch_script 100 -` failed: Invalid user id")
        return squeue(argv, timeout)

    with running_signer(key[0], tmp_path / "s.sock", no_operator), \
            pytest.raises(ReceiptError, match="would not show job 41's batch script .* Slurm operator"):
        ask(tmp_path / "s.sock")


def test_one_job_signs_one_run_however_its_comment_changes(key, tmp_path):
    """The review's burst: one job changing its comment to name run after run. Its batch script's
    header names the run it was submitted for: each other is refused (and leaves no ledger file)."""
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    squeue = FakeSqueue({"job_id": 41})
    with running_signer(key[0], tmp_path / "s.sock", squeue, ledger=ledger):
        assert ask(tmp_path / "s.sock")["payload"]["run_id"] == "run-1"
        squeue.text = squeue.text.replace("ft-run=run-1", "ft-run=run-2")
        with pytest.raises(ReceiptError, match="job 41's batch script is not ft's: .* of run run-2"):
            ask(tmp_path / "s.sock", run_id="run-2")
    runs = sorted(path.name for path in (ledger / str(os.getuid())).glob("*.jsonl"))
    assert runs == ["run-1.jsonl"]


def test_a_receipt_whose_first_entry_records_a_plain_script_is_not_signed(key, tmp_path):
    """The second review's attack: entry 1 made up to record the `sleep` script the job really runs.
    The digests match; the script is not ft's, and nothing is signed."""
    sleep = "#!/bin/bash\nsleep 600\n"
    squeue = FakeSqueue({"job_id": 41}, scripts={"41": sleep})
    with running_signer(key[0], tmp_path / "s.sock", squeue), \
            pytest.raises(ReceiptError, match="job 41's batch script is not ft's"):
        ask(tmp_path / "s.sock", first=submit_entry(script=sleep))
