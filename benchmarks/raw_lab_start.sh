#!/usr/bin/env bash
# Baseline for benchmarks/lab_up.py: start a stopped lab with plain commands, no Ansible.
# Uses the configuration the lab playbook left in /etc/slurm; the lab's own layout is assumed
# (nodeI at 10.213.7.(10+I) in namespace ftlab-nodeI). Not a way to run the lab: use `ft lab up`.
#   raw_lab_start.sh NODES
set -euo pipefail
nodes=${1:?usage: raw_lab_start.sh NODES}
subnet=10.213.7

# Safety first: the guard route keeps lab traffic on this machine if the bridge is missing.
ip route show type blackhole "$subnet.0/24" | grep -q . || ip route add blackhole "$subnet.0/24" metric 4000
ip link add ftlab0 type bridge
ip addr add "$subnet.1/24" dev ftlab0
ip link set ftlab0 up
for i in $(seq 1 "$nodes"); do
    ns=ftlab-node$i
    ip netns add "$ns"
    ip link add "ftl-node$i" type veth peer name eth0 netns "$ns"
    ip link set "ftl-node$i" master ftlab0 up
    ip -n "$ns" addr add "$subnet.$((10 + i))/24" dev eth0
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
    mkdir -p "/var/lib/ft-lab/dev/node$i"
    for g in 0 1 2 3; do
        [ -c "/var/lib/ft-lab/dev/node$i/nvidia$g" ] || mknod "/var/lib/ft-lab/dev/node$i/nvidia$g" c 1 3
    done
done

mkdir -p /run/munge /run/slurm && chown munge:munge /run/munge && chown slurm:slurm /run/slurm
runuser -u munge -- /usr/sbin/munged
setsid /etc/init.d/mariadb start >/dev/null
unshare --uts sh -c 'hostname ctl && exec /usr/sbin/slurmdbd'
until ss -Hltn 'sport = :6819' | grep -q .; do sleep 0.05; done
unshare --uts sh -c 'hostname ctl && exec /usr/sbin/slurmctld'
until ss -Hltn 'sport = :6817' | grep -q .; do sleep 0.05; done
for i in $(seq 1 "$nodes"); do
    nsenter --net="/run/netns/ftlab-node$i" unshare --uts sh -c "hostname node$i && exec /usr/sbin/slurmd"
done
export SLURM_CONF=/etc/slurm/slurm.conf
until [ "$(sinfo --noheader --Node --partition=standard --format=%T | grep -cx idle)" -eq "$nodes" ]; do sleep 0.1; done
