"""Processes of the lab: liveness of its daemons, and what lives in a node's namespace.

The liveness rule matches the Ansible module ft.cluster.daemon: a pid file counts only when its
PID is alive, runs the daemon's program, and sits in the node's network namespace.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

from toolkit.lab.manifest import LabDaemon

NETNS_DIR = "/run/netns"
# A lab node's one link, inside its namespace (the lab_nodes Ansible module names it).
NODE_LINK = "eth0"


def read_pid(pidfile: str) -> int | None:
    try:
        with open(pidfile) as handle:
            return int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def netns_exists(netns: str) -> bool:
    return os.path.exists(os.path.join(NETNS_DIR, netns))


def in_netns(pid: int, netns: str) -> bool:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(os.path.join(NETNS_DIR, netns)).st_ino
    except OSError:
        return False


def daemon_pid(daemon: LabDaemon) -> int | None:
    """PID of a running lab daemon, or None when it is not running."""
    pid = read_pid(daemon.pidfile)
    if pid is None:
        return None
    try:
        exe = os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")
    except OSError:
        return None
    expected = os.path.realpath(daemon.exe) if os.path.isabs(daemon.exe) else None
    if (exe != expected) if expected else (os.path.basename(exe) != daemon.exe):
        return None
    if daemon.netns and not in_netns(pid, daemon.netns):
        return None
    return pid


def netns_pids(netns: str) -> list[int]:
    result = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, check=False)
    return [int(pid) for pid in result.stdout.split()]


def cut_link(netns: str) -> None:
    """Take a lab node's link down: what it sends from now on reaches nobody, what is sent to it is
    lost. A node that loses power says nothing, while a process killed on a live network closes its
    connections in its peers' sight (a FIN or RST within milliseconds), which Slurm and gloo act on
    at once: a crash without the cut would test a kinder failure than the one it stands for.
    `ft lab up` brings the link back with the node."""
    subprocess.run(["ip", "-n", netns, "link", "set", NODE_LINK, "down"], check=True, capture_output=True)


def kill_netns(netns: str, timeout: float = 5.0) -> list[int]:
    """SIGKILL every process in a lab node's namespace: a node crash, as seen by Slurm.

    Killing slurmd alone does not stop the node's job tasks; a crashed node loses all of them.
    Only lab namespaces are passed here, so every PID belongs to the lab.
    """
    killed: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = netns_pids(netns)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return sorted(set(killed))
