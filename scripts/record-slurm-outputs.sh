#!/usr/bin/env bash
# Record what the lab's Slurm answers to every command ft asks it (toolkit/slurm), as unit-test
# fixtures: tests/unit/recorded/slurm/<release>/. Run as root on a lab that is up, once per release:
#
#   ft lab up --slurm 24.11 && scripts/record-slurm-outputs.sh
#
# What it does: submits a job of ft's shape (2 nodes, GPUs, the comment ft-run=recorded) and a job
# that waits behind a dependency, records the queue (squeue, JSON and text), the nodes (sinfo),
# partitions, configuration, QOS and associations (scontrol, sacctmgr), sbatch --test-only's answer;
# requeues the running job once (Slurm keeps each allocation), ends both, and records the
# accounting (sacct --json --duplicates) and node events. Host-specific values (times, node
# addresses) stay as Slurm printed them: the tests read shapes, not values.
set -euo pipefail
export SLURM_CONF="${SLURM_CONF:-/etc/slurm/slurm.conf}"  # never let a Slurm tool look its controller up in DNS
[[ -f "$SLURM_CONF" ]] || { echo "no lab: $SLURM_CONF is missing (ft lab up)" >&2; exit 2; }

release="$(sinfo --version | awk '{print $2}')"
out="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/tests/unit/recorded/slurm/${release%.*}"
mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "recording Slurm $release into $out"

cat > "$work/job.sh" <<'EOF'
#!/bin/bash
#SBATCH --job-name=ft-recorded
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=2
#SBATCH --time=10
#SBATCH --requeue
#SBATCH --comment=ft-run=recorded
sleep 300
EOF
chmod +x "$work/job.sh"
cd "$work"

sbatch --test-only "$work/job.sh" > "$out/sbatch-test-only.txt" 2>&1 || true
job="$(sbatch --parsable "$work/job.sh")"
job="${job%%;*}"
waiting="$(sbatch --parsable --dependency="afterok:$job" --job-name=ft-waiting --comment=ft-run=waiting \
    --gpus-per-node=1 --time=5 --wrap 'true')"
waiting="${waiting%%;*}"
for _ in $(seq 60); do
    [[ "$(squeue --noheader --jobs "$job" --format=%T)" == RUNNING ]] && break
    sleep 1
done

squeue --all --json > "$out/squeue-all.json"
squeue --json --jobs "$job" > "$out/squeue-job.json"
squeue --all --noheader "--Format=Partition:|,State:|,EligibleTime:|,Reason:|,JobID:|" > "$out/squeue-queue-lines.txt"
squeue --noheader --user "$(id -u)" --format='%A|%k' > "$out/squeue-own.txt"
squeue --noheader --jobs "$job" --format %B > "$out/squeue-batch-host.txt"
scontrol show job -o "$job" > "$out/scontrol-show-job.txt"
sinfo --Node --json > "$out/sinfo-nodes.json"
sinfo --Node --noheader --format='%N|%T|%E' > "$out/sinfo-node-states.txt"
sinfo --Node --noheader --format='%N|%P|%G|%c|%m' > "$out/sinfo-node-gres.txt"
sinfo --noheader --format=%R > "$out/sinfo-partitions.txt"
scontrol show partition --oneliner > "$out/scontrol-show-partition.txt"
scontrol show config > "$out/scontrol-show-config.txt"
sacctmgr --noheader --parsable2 show qos format=Name > "$out/sacctmgr-qos.txt"
sacctmgr --noheader --parsable2 show associations user=root format=Account,QOS > "$out/sacctmgr-associations.txt"
scontrol show assoc_mgr flags=assoc accounts=capped > "$out/scontrol-assoc-mgr.txt"

# A requeue: Slurm keeps the first allocation (REQUEUED) and the job waits again (its flags).
scontrol requeue "$job"
sleep 2
squeue --json --jobs "$job" > "$out/squeue-requeued.json"
scancel "$job" "$waiting"
for _ in $(seq 60); do
    [[ -z "$(squeue --noheader --jobs "$job,$waiting" 2>/dev/null)" ]] && break
    sleep 1
done
sleep 3  # slurmctld hands the job's end to slurmdbd
sacct --allusers --duplicates -X --json --jobs "$job,$waiting" > "$out/sacct-jobs.json"
sacctmgr --noheader --parsable2 show event start=now-1days format=nodename,start > "$out/sacctmgr-events.txt"
echo "$release" > "$out/VERSION"
ls -l "$out"
