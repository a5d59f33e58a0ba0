"""The guard every test runs under: nothing leaves this machine, DNS queries included."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.support.network_guard import OffMachineTraffic


@pytest.mark.parametrize("host", ["example-datasets.s3.amazonaws.com", "8.8.8.8", "169.254.169.254", "10.0.0.1"])
def test_addresses_off_this_machine_are_refused_before_any_packet(host):
    with pytest.raises(OffMachineTraffic, match="is not on this machine"):
        socket.getaddrinfo(host, 443)
    with socket.socket() as sock, pytest.raises(OffMachineTraffic):
        sock.connect((host, 443))


def test_loopback_is_allowed():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname(), timeout=5):
            pass


def test_processes_started_by_tests_send_s3_to_loopback():
    """A subprocess (an `ft` command) has no guard of its own: its S3 client defaults to loopback."""
    probe = ("import fsspec\n"
             "fs = fsspec.filesystem('s3', skip_instance_cache=True, config_kwargs={'retries': {'max_attempts': 1}})\n"
             "try:\n    fs.info('example-datasets/support-chat/train.jsonl')\n"
             "except Exception as exc:\n    print(type(exc).__name__, exc)\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"})
    assert "http://127.0.0.1:9/" in result.stdout, result.stdout + result.stderr
