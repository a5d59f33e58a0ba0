#!/usr/bin/python
"""The local lab's compute "hosts": one network namespace per node on a private bridge."""

from __future__ import annotations

DOCUMENTATION = r"""
module: lab_nodes
short_description: Network namespaces, bridge, guard route and fake GPU devices of ft's local lab
description:
  - Makes one network namespace per lab node, joined by a veth pair to a bridge in the root
    namespace, each with its own address and no default route.
  - Installs a blackhole guard route for the lab subnet before the bridge exists and never removes
    it, so that lab traffic is dropped locally instead of leaving the machine when the bridge is gone.
  - Creates fake GPU character devices per node (aliases of /dev/null) for Slurm's gres.conf.
  - Prunes namespaces with the lab prefix that are not wanted (stale nodes of an earlier, larger lab).
options:
  state:
    description: present builds the nodes; absent removes nodes and bridge (the guard route stays).
    choices: [present, absent]
    default: present
    type: str
  bridge:
    description: Bridge interface name.
    required: true
    type: str
  bridge_address:
    description: Address of the bridge with prefix length (the controller's address).
    required: true
    type: str
  subnet:
    description: The lab subnet (network/prefix) that the guard route covers.
    required: true
    type: str
  netns_prefix:
    description: Prefix of the namespaces this module owns.
    required: true
    type: str
  nodes:
    description: Wanted nodes, each a dict with name and address (without prefix length).
    type: list
    elements: dict
    default: []
  gpu_dir:
    description: Directory holding a sub-directory of fake GPU devices per node.
    type: path
  gpus_per_node:
    description: Fake GPU devices per node.
    type: int
    default: 0
  prune:
    description: Remove the lab's namespaces not in nodes. False when healing some nodes of a larger lab.
    type: bool
    default: true
author: ft
"""

EXAMPLES = r"""
- name: Lab nodes
  ft.cluster.lab_nodes:
    bridge: ftlab0
    bridge_address: 10.213.7.1/24
    subnet: 10.213.7.0/24
    netns_prefix: ftlab-
    nodes: [{name: node1, address: 10.213.7.11}]
    gpu_dir: /var/lib/ft-lab/dev
    gpus_per_node: 4
"""

RETURN = r"""
actions: {description: What was (or in check mode would be) done., returned: always, type: list}
"""

import json
import os
import shutil
import signal
import stat
import subprocess
import time

from ansible.module_utils.basic import AnsibleModule

# Fake GPUs are character devices with NVIDIA's numbers (major 195, minor the index), as
# /dev/nvidiaN are: Slurm needs character devices, and its device cgroup then allows a job the GPUs
# it was given and denies the rest, which a test can see (no driver here: opening an allowed one
# fails with ENXIO, a denied one with EPERM). Aliases of /dev/null would deny a job /dev/null.
NVIDIA_MAJOR = 195


def gpu_device(index):
    return os.makedev(NVIDIA_MAJOR, index)


class Lab:
    def __init__(self, module):
        self.module = module
        self.params = module.params
        self.actions = []

    # -- helpers -------------------------------------------------------------------------------
    def ip_json(self, *args):
        result = subprocess.run(["ip", "-j", *args], capture_output=True, text=True, check=False)
        if result.returncode != 0 or not result.stdout.strip():
            return []
        return json.loads(result.stdout)

    def act(self, description, *commands):
        """Record an action and, outside check mode, run its commands (each an argv list)."""
        self.actions.append(description)
        if self.module.check_mode:
            return
        for command in commands:
            result = subprocess.run(command, capture_output=True, text=True, check=False)
            if result.returncode != 0:
                self.module.fail_json(msg=f"{description}: {' '.join(command)} failed: {result.stderr.strip()}",
                                      actions=self.actions)

    @staticmethod
    def veth_name(node):
        return f"ftl-{node}"[:15]  # interface names are limited to 15 characters

    def netns_name(self, node):
        return self.params["netns_prefix"] + node

    def existing_netns(self):
        return {entry["name"] for entry in self.ip_json("netns", "list")}

    def link(self, name, netns=None):
        args = ("-n", netns) if netns else ()
        links = self.ip_json(*args, "addr", "show", "dev", name) if self.link_exists(name, netns) else []
        return links[0] if links else None

    @staticmethod
    def link_exists(name, netns=None):
        command = ["ip"] + (["-n", netns] if netns else []) + ["link", "show", "dev", name]
        return subprocess.run(command, capture_output=True, check=False).returncode == 0

    @staticmethod
    def addresses(link):
        return {f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", []) if a.get("family") == "inet"}

    # -- pieces --------------------------------------------------------------------------------
    def guard_route(self):
        subnet = self.params["subnet"]
        routes = self.ip_json("route", "show", "type", "blackhole", subnet)
        if not routes:
            self.act(f"add blackhole guard route for {subnet}",
                     ["ip", "route", "add", "blackhole", subnet, "metric", "4000"])

    def bridge(self):
        name, address = self.params["bridge"], self.params["bridge_address"]
        link = self.link(name)
        if link is None:
            self.act(f"create bridge {name}", ["ip", "link", "add", name, "type", "bridge"])
            link = {"flags": [], "addr_info": []}
        if address not in self.addresses(link):
            self.act(f"address {address} on {name}", ["ip", "addr", "replace", address, "dev", name])
        if "UP" not in link.get("flags", []):
            self.act(f"bring {name} up", ["ip", "link", "set", name, "up"])

    def node(self, node, existing):
        name, address = node["name"], node["address"]
        netns, veth = self.netns_name(name), self.veth_name(name)
        prefix = self.params["bridge_address"].split("/")[1]
        if netns not in existing:
            self.act(f"create namespace {netns}", ["ip", "netns", "add", netns])
        if not self.link_exists(veth):
            self.act(f"veth {veth} into {netns}",
                     ["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns])
        host_side = self.link(veth) or {"flags": []}
        if host_side.get("master") != self.params["bridge"] or "UP" not in host_side.get("flags", []):
            self.act(f"attach {veth} to {self.params['bridge']}",
                     ["ip", "link", "set", veth, "master", self.params["bridge"], "up"])
        inside = self.link("eth0", netns) if netns in existing else None
        inside = inside or {"flags": [], "addr_info": []}
        wanted = f"{address}/{prefix}"
        stale = self.addresses(inside) - {wanted}
        for old in sorted(stale):
            self.act(f"remove stale address {old} in {netns}", ["ip", "-n", netns, "addr", "del", old, "dev", "eth0"])
        if wanted not in self.addresses(inside):
            self.act(f"address {wanted} in {netns}", ["ip", "-n", netns, "addr", "add", wanted, "dev", "eth0"])
        if "UP" not in inside.get("flags", []):
            self.act(f"bring up {netns}", ["ip", "-n", netns, "link", "set", "lo", "up"],
                     ["ip", "-n", netns, "link", "set", "eth0", "up"])
        self.fake_gpus(name)

    def fake_gpus(self, name):
        if not self.params["gpu_dir"]:
            return
        directory = os.path.join(self.params["gpu_dir"], name)
        for index in range(self.params["gpus_per_node"]):
            path = os.path.join(directory, f"nvidia{index}")
            try:
                info = os.stat(path)
                if stat.S_ISCHR(info.st_mode) and info.st_rdev == gpu_device(index):
                    continue
            except FileNotFoundError:
                pass
            self.actions.append(f"fake GPU device {path}")
            if not self.module.check_mode:
                os.makedirs(directory, exist_ok=True)
                if os.path.lexists(path):
                    os.unlink(path)
                os.mknod(path, stat.S_IFCHR | 0o666, gpu_device(index))
        # Devices beyond the wanted count (an earlier lab with more GPUs) would mislead gres.conf.
        if os.path.isdir(directory):
            for entry in sorted(os.listdir(directory)):
                if entry.startswith("nvidia") and entry[6:].isdigit() and int(entry[6:]) >= self.params["gpus_per_node"]:
                    self.actions.append(f"remove surplus fake GPU {entry} of {name}")
                    if not self.module.check_mode:
                        os.unlink(os.path.join(directory, entry))

    def remove_nodes(self, namespaces):
        """Delete lab namespaces, first ending the processes in them (all of them the lab's own:
        slurmd and job tasks). All are signalled at once, so teardown does not grow with the lab."""
        if not namespaces:
            return
        self.actions.extend(f"remove namespace {netns}" for netns in namespaces)
        if self.module.check_mode:
            return
        for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 3.0)):
            alive = self.signal_namespaces(namespaces, sig)
            deadline = time.monotonic() + grace
            while alive and time.monotonic() < deadline:
                time.sleep(0.05)
                alive = [pid for pid in alive if os.path.exists(f"/proc/{pid}")]
            if not alive:
                break
        prefix = self.params["netns_prefix"]
        for netns in namespaces:
            node = netns[len(prefix):]
            subprocess.run(["ip", "netns", "del", netns], check=False)
            if self.link_exists(self.veth_name(node)):
                subprocess.run(["ip", "link", "del", self.veth_name(node)], check=False)
            if self.params["gpu_dir"]:
                shutil.rmtree(os.path.join(self.params["gpu_dir"], node), ignore_errors=True)

    @staticmethod
    def signal_namespaces(namespaces, sig):
        signalled = []
        for netns in namespaces:
            pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, check=False)
            for pid in (int(p) for p in pids.stdout.split()):
                try:
                    os.kill(pid, sig)
                    signalled.append(pid)
                except ProcessLookupError:
                    pass
        return signalled

    # -- entry points --------------------------------------------------------------------------
    def present(self):
        self.guard_route()
        self.bridge()
        existing = self.existing_netns()
        wanted = {self.netns_name(n["name"]) for n in self.params["nodes"]}
        if self.params["prune"]:
            self.remove_nodes(sorted(n for n in existing - wanted if n.startswith(self.params["netns_prefix"])))
        for node in self.params["nodes"]:
            self.node(node, existing)

    def absent(self):
        self.guard_route()
        self.remove_nodes(sorted(n for n in self.existing_netns() if n.startswith(self.params["netns_prefix"])))
        if self.link_exists(self.params["bridge"]):
            self.act(f"delete bridge {self.params['bridge']}", ["ip", "link", "del", self.params["bridge"]])


def main():
    module = AnsibleModule(
        argument_spec={
            "state": {"type": "str", "default": "present", "choices": ["present", "absent"]},
            "bridge": {"type": "str", "required": True},
            "bridge_address": {"type": "str", "required": True},
            "subnet": {"type": "str", "required": True},
            "netns_prefix": {"type": "str", "required": True},
            "nodes": {"type": "list", "elements": "dict", "default": []},
            "gpu_dir": {"type": "path"},
            "gpus_per_node": {"type": "int", "default": 0},
            "prune": {"type": "bool", "default": True},
        },
        supports_check_mode=True,
    )
    lab = Lab(module)
    if module.params["state"] == "present":
        lab.present()
    else:
        lab.absent()
    module.exit_json(changed=bool(lab.actions), actions=lab.actions)


if __name__ == "__main__":
    main()
