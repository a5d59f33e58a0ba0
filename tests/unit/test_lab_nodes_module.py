"""ft.cluster.lab_nodes on real kernel namespaces, with a prefix, bridge and subnet of its own so
that it never touches the running lab."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import yaml

from toolkit.lab.provision import run_playbook

PREFIX = "ftlabtest-"
BRIDGE = "ftlabtest0"
SUBNET = "10.213.99.0/24"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates network namespaces: needs root")


SERVER = """
import socket
s = socket.create_server(("10.213.99.12", 7777))
print("listening", flush=True)
conn, _ = s.accept()
conn.sendall(b"hello from 10.213.99.12")
conn.close()
"""
CLIENT = """
import socket
print(socket.create_connection(("10.213.99.12", 7777), timeout=5).recv(100).decode())
"""


def apply(tmp_path, state="present", nodes=(), check=False, prune=True):
    task = {"name": "lab nodes", "ft.cluster.lab_nodes": {
        "state": state, "bridge": BRIDGE, "bridge_address": "10.213.99.1/24", "subnet": SUBNET,
        "netns_prefix": PREFIX, "gpu_dir": str(tmp_path / "dev"), "gpus_per_node": 2, "prune": prune,
        "nodes": [{"name": name, "address": f"10.213.99.{10 + 'abcdefgh'.index(name) + 1}"} for name in nodes]}}
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump([{"name": "t", "hosts": "localhost", "gather_facts": False,
                                         "tasks": [task]}]))
    result = run_playbook(str(playbook), inventory="localhost,", check=check,
                          extra_vars={"ansible_connection": "local", "ansible_python_interpreter": sys.executable})
    assert result.ok, result.error
    return result


def namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith(PREFIX)}


def route_to(address: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", "route", "get", address], capture_output=True, text=True, check=False)


@pytest.fixture
def clean(tmp_path):
    yield
    apply(tmp_path, state="absent")


def test_nodes_get_namespaces_addresses_and_fake_gpus(tmp_path, clean):
    assert apply(tmp_path, nodes=["a", "b"]).changed == 1

    assert namespaces() == {PREFIX + "a", PREFIX + "b"}
    inside = subprocess.run(["ip", "-n", PREFIX + "b", "-o", "-4", "addr", "show", "dev", "eth0"],
                            capture_output=True, text=True, check=True).stdout
    assert "10.213.99.12/24" in inside
    routes = subprocess.run(["ip", "-n", PREFIX + "a", "route"], capture_output=True, text=True).stdout
    assert "default" not in routes  # a node namespace has no way off the machine
    device = os.stat(tmp_path / "dev" / "a" / "nvidia1")
    assert stat.S_ISCHR(device.st_mode) and device.st_rdev == os.makedev(195, 1)  # NVIDIA's numbers, as /dev/nvidia1
    # The bridge carries the subnet: node a reaches a server listening in node b.
    server = subprocess.Popen(["nsenter", f"--net=/run/netns/{PREFIX}b", sys.executable, "-c", SERVER],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "listening"
        client = subprocess.run(["nsenter", f"--net=/run/netns/{PREFIX}a", sys.executable, "-c", CLIENT],
                                capture_output=True, text=True, timeout=20)
        assert client.stdout.strip() == "hello from 10.213.99.12", client.stderr
    finally:
        server.kill()
        server.wait()

    assert apply(tmp_path, nodes=["a", "b"]).changed == 0


def test_shrinking_prunes_surplus_nodes(tmp_path, clean):
    apply(tmp_path, nodes=["a", "b", "c"])
    sleeper = subprocess.Popen(["nsenter", f"--net=/run/netns/{PREFIX}c", "sleep", "60"])
    try:
        assert apply(tmp_path, nodes=["a", "b"]).changed == 1
        assert namespaces() == {PREFIX + "a", PREFIX + "b"}
        assert sleeper.wait(timeout=10) != 0  # what ran in the removed node was ended with it
    finally:
        if sleeper.poll() is None:
            sleeper.kill()


def test_healing_some_nodes_rebuilds_their_gpus_and_leaves_the_others_alone(tmp_path, clean):
    """`ft lab up` on a lab of slices heals only the nodes it was asked for (lab-heal.yml: prune off)."""
    apply(tmp_path, nodes=["a", "b", "c"])
    (tmp_path / "dev" / "b" / "nvidia1").unlink()  # `ft chaos gpu-bad`
    assert apply(tmp_path, nodes=["b"], prune=False).changed == 1
    assert namespaces() == {PREFIX + "a", PREFIX + "b", PREFIX + "c"}
    assert (tmp_path / "dev" / "b" / "nvidia1").is_char_device()


def test_guard_route_stays_when_the_bridge_is_gone(tmp_path):
    apply(tmp_path, nodes=["a"])
    apply(tmp_path, state="absent")

    assert namespaces() == set()
    blackholes = subprocess.run(["ip", "route", "show", "type", "blackhole", SUBNET],
                                capture_output=True, text=True).stdout
    assert SUBNET in blackholes
    # Without the bridge, a lab address is dropped here rather than routed off the machine.
    assert route_to("10.213.99.11").returncode != 0


def test_check_mode_changes_nothing(tmp_path, clean):
    assert apply(tmp_path, nodes=["a"], check=True).changed == 1
    assert namespaces() == set()
