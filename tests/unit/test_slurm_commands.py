"""What ft reads from Slurm's own text: `scontrol show config` and host lists."""

from __future__ import annotations

from toolkit.slurm.commands import expand_hostlist, parse_config

CONFIG = """Configuration data as of 2026-11-24T23:51:00
AccountingStorageEnforce = associations,limits,qos,safe
AccountingStoreFlags    = job_comment
ClusterName             = lab
PrivateData             = none
SlurmctldParameters     = (null)
JobCompLoc              = /var/log/slurm/jobcomp.log

Slurmctld(primary) at ctl is UP
"""


def test_config_is_read_by_name():
    config = parse_config(CONFIG)
    assert config["ClusterName"] == "lab" and config["AccountingStoreFlags"] == "job_comment"
    assert config["SlurmctldParameters"] == "(null)" and "Slurmctld(primary) at ctl is UP" not in config


def test_host_lists_expand_as_scontrol_show_hostnames_does():
    assert expand_hostlist("node[1-3,07],gpu-a") == ["node1", "node2", "node3", "node07", "gpu-a"]
    assert expand_hostlist("rack[1-2]-n[1-2]") == ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]
    assert expand_hostlist("") == [] and expand_hostlist("n[a-b]") == ["n[a-b]"]  # not a range: as written
    assert len(expand_hostlist("n[1-99999999]")) == 1  # no list of a hundred million names


def test_node_addresses_are_slurms_nodeaddr_once_per_node():
    """sinfo lists a node once per partition; a node without an address says nothing."""
    import subprocess

    from toolkit.slurm.nodes import node_addresses

    answer = "gpu-001|10.1.0.11\ngpu-001|10.1.0.11\ngpu-002|(null)\nother|10.9.9.9\n"

    def run(argv, timeout, check):
        assert "--format=%N|%o" in argv and "gpu-001,gpu-002" in argv
        return subprocess.CompletedProcess(argv, 0, answer, "")

    assert node_addresses(["gpu-001", "gpu-002"], run) == {"gpu-001": "10.1.0.11"}
