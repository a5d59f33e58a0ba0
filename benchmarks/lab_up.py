"""Benchmark: how much does provisioning the lab through Ansible cost over starting its daemons raw?

In one run on this machine (packages already installed):
  raw       the lab's namespaces and daemons started by a plain script (benchmarks/raw_lab_start.sh)
  up_cold   `ft lab up` from a stopped lab (targets: <= 30 s)
  up_warm   `ft lab up` on a lab that is up (target: <= 10 s)
  reprov    `ft lab up --reprovision` on a lab that is up: the full playbook, nothing to change
Each is timed to "every node idle". Prints seconds and ratios against raw. Run as root:
    python benchmarks/lab_up.py [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FT = [sys.executable, "-m", "toolkit"]


def timed(argv: list[str]) -> float:
    started = time.monotonic()
    subprocess.run(argv, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    return time.monotonic() - started


def lab_down() -> None:
    subprocess.run([*FT, "lab", "down"], check=True, cwd=REPO, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    samples: dict[str, list[float]] = {"raw": [], "up_cold": [], "up_warm": [], "reprov": []}
    subprocess.run([*FT, "lab", "up"], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    lab = json.loads(Path("/var/lib/ft-lab/lab.json").read_text())
    for round_ in range(args.rounds):
        lab_down()
        samples["raw"].append(timed(["bash", str(REPO / "benchmarks/raw_lab_start.sh"), str(len(lab["nodes"]))]))
        lab_down()
        samples["up_cold"].append(timed([*FT, "lab", "up"]))
        samples["up_warm"].append(timed([*FT, "lab", "up"]))
        samples["reprov"].append(timed([*FT, "lab", "up", "--reprovision"]))
        print(f"round {round_ + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in samples.items()), flush=True)

    raw = statistics.median(samples["raw"])
    print(f"\nlab bring-up, {len(lab['nodes'])} nodes, median of {args.rounds} (ratio to raw daemon start)")
    targets = {"up_cold": 30.0, "up_warm": 10.0}
    for name, values in samples.items():
        median = statistics.median(values)
        target = f"  target <= {targets[name]:.0f} s: {'met' if median <= targets[name] else 'MISSED'}" \
            if name in targets else ""
        print(f"  {name:8s} {median:7.2f} s   x{median / raw:6.2f}{target}")


if __name__ == "__main__":
    main()
