"""Benchmark the login-node commands, in one run on the lab (run as root with the lab up):

  ft render            a full `ft render` process (target: <= 150 ms a call)
  ft submit            `ft submit --preflight` of the tiny 2-node recipe, a full process
  bare submitit        a process that submits the same 2-node job with plain submitit
  bare sbatch          `sbatch` of the same rendered script
  import floor         a process that only imports what `ft render` cannot do without: typer (the
                       CLI), pydantic (the recipe's checks: one model made), yaml (the recipe),
                       jinja2 (the script)
  import floor+submit  the same and submitit (what `ft submit` cannot do without)

Prints medians, the ratio ft submit / bare submitit (target <= 1.3x), and each ft command against
its import floor: what ft itself adds on top of the libraries it is built on. Submitted jobs are
cancelled right away. python benchmarks/control_plane.py [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny-lora-sft.yaml"
BARE_SUBMITIT = """
import submitit, sys
executor = submitit.AutoExecutor(folder=sys.argv[1], cluster="slurm")
executor.update_parameters(nodes=2, tasks_per_node=1, slurm_gpus_per_node=1, timeout_min=20,
                           slurm_partition="standard", name="bench-bare")
print(executor.submit(print, "hello").job_id)
"""


def timed(argv: list[str], env: dict) -> tuple[float, str]:
    started = time.monotonic()
    result = subprocess.run(argv, capture_output=True, text=True, env=env, check=True, cwd=REPO)
    return time.monotonic() - started, result.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ft-bench-", dir="/var/lib/ft-lab/shared"))
    env = dict(os.environ, FT_RUNS_DIR=str(work / "runs"), SLURM_CONF="/etc/slurm/slurm.conf")
    ft = [sys.executable, "-m", "toolkit"]
    script = work / "job.sbatch"
    subprocess.run([*ft, "render", str(RECIPE), "--preflight", "--run-id", "bench", "-o", str(script)],
                   check=True, env=env, capture_output=True)
    samples: dict[str, list[float]] = {"ft render": [], "ft submit": [], "bare submitit": [], "bare sbatch": [],
                                       "import floor": [], "import floor+submit": []}
    # pydantic imports its model machinery when a first model is made: the floor makes one.
    floor = ("import typer, yaml, jinja2\nfrom pydantic import BaseModel, Field\n"
             "class Floor(BaseModel):\n    x: int = Field(1, ge=0)\nFloor(x=1)\n")
    jobs: list[str] = []
    for _ in range(args.rounds):
        seconds, _ = timed([*ft, "render", str(RECIPE)], env)
        samples["ft render"].append(seconds)
        seconds, out = timed([*ft, "submit", "--preflight", "--json", str(RECIPE)], env)
        samples["ft submit"].append(seconds)
        jobs.append(json.loads(out)["job_id"])
        seconds, out = timed([sys.executable, "-c", BARE_SUBMITIT, str(work / "submitit")], env)
        samples["bare submitit"].append(seconds)
        jobs.append(out.strip())
        seconds, out = timed(["sbatch", "--parsable", str(script)], env)
        samples["bare sbatch"].append(seconds)
        jobs.append(out.strip().split(";")[0])
        subprocess.run(["scancel", *jobs[-3:]], env=env, check=False)
        samples["import floor"].append(timed([sys.executable, "-c", floor], env)[0])
        samples["import floor+submit"].append(timed([sys.executable, "-c", "import submitit\n" + floor], env)[0])
    medians = {name: statistics.median(values) for name, values in samples.items()}
    print(f"median of {args.rounds} rounds")
    for name, value in medians.items():
        print(f"  {name:14s} {value * 1000:8.1f} ms")
    print(f"ft render: {'met' if medians['ft render'] <= 0.150 else 'MISSED'} target <= 150 ms")
    ratio = medians["ft submit"] / medians["bare submitit"]
    print(f"ft submit / bare submitit: x{ratio:.2f} ({'met' if ratio <= 1.3 else 'MISSED'} target <= 1.3x)")
    floor_ratio = (medians["import floor+submit"] + medians["bare sbatch"]) / medians["bare submitit"]
    print(f"  (the libraries alone, imported, plus one sbatch: x{floor_ratio:.2f} a bare submitit submit)")
    print(f"ft render / its import floor: x{medians['ft render'] / medians['import floor']:.2f}; "
          f"ft submit / its floor (imports + sbatch): "
          f"x{medians['ft submit'] / (medians['import floor+submit'] + medians['bare sbatch']):.2f}")


if __name__ == "__main__":
    main()
