"""Tests never reach past this machine: a guard on the test process's sockets, and an environment
for the processes tests start that keeps any S3 client on loopback.

Allowed: loopback, the lab's own subnet (its node namespaces), Unix sockets, and names that
/etc/hosts resolves to those addresses. Anything else fails at once, naming the address and the
test's mistake, instead of sending a packet (a DNS query included) off the machine.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from pathlib import Path

LAB_SUBNET = ipaddress.ip_network("10.213.7.0/24")  # ansible/inventories/lab: lab_subnet
# Nothing listens on the discard port: an S3 client a test forgot to point at the test server
# fails on loopback instead of asking a public endpoint.
SAFE_ENVIRONMENT = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_EC2_METADATA_DISABLED": "true",
                    "HF_HUB_OFFLINE": "1"}


class OffMachineTraffic(ConnectionError):
    pass


def allowed_address(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    return address.is_loopback or address in LAB_SUBNET


def local_names() -> set[str]:
    names = {"localhost"}
    try:
        lines = Path("/etc/hosts").read_text().splitlines()
    except OSError:
        return names
    for line in lines:
        fields = line.split("#")[0].split()
        if len(fields) >= 2 and allowed_address(fields[0]):
            names.update(fields[1:])
    return names


# Socket events (PEP 578 audit events) and where their host argument is.
AUDITED = {"socket.getaddrinfo": 0, "socket.gethostbyname": 0, "socket.gethostbyaddr": 0, "socket.connect": 1,
           "socket.sendto": 1, "socket.sendmsg": 1}


def install() -> None:
    """Guard the whole test process, fixtures of every scope included: an audit hook sees every
    name lookup, connection and datagram, whichever library makes it. Idempotent."""
    if getattr(install, "done", False):
        return
    names = local_names() | {socket.gethostname()}

    def check(host) -> None:
        if host is None or host == "" or host == b"":
            return
        text = host.decode() if isinstance(host, bytes) else str(host)
        if not (allowed_address(text) or text in names):
            raise OffMachineTraffic(f"test network guard: {text!r} is not on this machine (loopback or the lab's "
                                    f"{LAB_SUBNET}); point the test at a local server")

    def check_address(sock, address) -> None:  # only IP sockets leave the machine
        if sock.family in (socket.AF_INET, socket.AF_INET6) and isinstance(address, tuple):
            check(address[0])

    def hook(event: str, args: tuple) -> None:
        position = AUDITED.get(event)
        if position == 0:
            check(args[0])
        elif position == 1:
            check_address(args[0], args[1])

    sys.addaudithook(hook)
    # connect() and sendto() resolve a host name before their audit event fires: check it first.
    for method in ("connect", "connect_ex", "sendto"):
        setattr(socket.socket, method, checked_method(getattr(socket.socket, method), check_address))
    for name, value in SAFE_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    install.done = True


def checked_method(real, check_address):
    def method(self, *args):
        check_address(self, args[-1])
        return real(self, *args)
    return method


def assert_no_process_wide_s3_config() -> None:
    """fsspec's per-protocol configuration applies to every filesystem a process makes afterwards: an
    endpoint set there would decide what later code reaches by the order of calls."""
    if "fsspec.config" in sys.modules:
        conf = sys.modules["fsspec.config"].conf
        assert not conf.get("s3"), f"something set fsspec's process-wide S3 configuration: {conf['s3']}"
