"""Tests never reach past this machine: a guard on the test process's sockets, and an environment
for the processes tests start that keeps any S3 client on loopback.

Allowed: loopback, the lab's own subnet (its node namespaces), Unix sockets, and names that
/etc/hosts resolves to those addresses. Anything else fails at once, naming the address and the
test's mistake, instead of sending a packet (a DNS query included) off the machine.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

LAB_SUBNET = ipaddress.ip_network("10.213.7.0/24")  # ansible/inventories/lab: lab_subnet
# Nothing listens on the discard port: an S3 client a test forgot to point at the test server
# fails on loopback instead of asking a public endpoint.
SAFE_ENVIRONMENT = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_EC2_METADATA_DISABLED": "true"}


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


def install(monkeypatch) -> None:
    names = local_names()
    real_getaddrinfo, real_connect, real_connect_ex = socket.getaddrinfo, socket.socket.connect, \
        socket.socket.connect_ex

    def check_host(host) -> None:
        if host is None:
            return
        text = host.decode() if isinstance(host, bytes) else str(host)
        if not (allowed_address(text) or text in names):
            raise OffMachineTraffic(f"test network guard: {text!r} is not on this machine (loopback or the lab's "
                                    f"{LAB_SUBNET}); point the test at a local server")

    def getaddrinfo(host, *args, **kwargs):
        check_host(host)
        return real_getaddrinfo(host, *args, **kwargs)

    def checked(real):
        def connect(self, address):
            if self.family in (socket.AF_INET, socket.AF_INET6):
                check_host(address[0])
            return real(self, address)
        return connect

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", checked(real_connect))
    monkeypatch.setattr(socket.socket, "connect_ex", checked(real_connect_ex))
    for name, value in SAFE_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    # An endpoint one test configured (toolkit.data.object_store.configure) never leaks into the next.
    import fsspec.config

    monkeypatch.setattr(fsspec.config, "conf", {})
