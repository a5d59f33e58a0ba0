"""False alarms of ft's watchdog on a loaded lab (issue 36, item 2), as root with the lab up:

The tiny 2-node LoRA run as shipped (recipes/tiny-lora-sft.yaml: every watchdog field at its
default; only the step count and the time limit raised, so that it trains for the whole window)
trains for --minutes while the unit test suite runs beside it, again and again (`pytest tests/unit
-n 2`: both of the machine's cores busy, imports, subprocesses, sockets). Nothing is injected, so
every node called lost, every hung rank, every restart is a false alarm.

Printed: the false alarms (target: zero), and how near the run came to one, the margins the
defaults leave on this machine:
- heartbeats: the longest gap between two heartbeats of any node (the supervisor's
  `heartbeat_gaps` events), against silence.QUIET_S (past it a node's slurmd is probed; a node is
  called lost only where that fails too);
- steps: the longest wait for a step of rank 0 against the hang limit the launcher applied at that
  moment (toolkit/watch/progress.py's rule, replayed on rank 0's stamped metrics): the highest
  ratio; 1.0 would be a hang called.

    python benchmarks/false_alarms.py [--minutes 60] [--no-load]
    python benchmarks/false_alarms.py --report RUN_DIR   # the figures of a run measured before
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from toolkit.lab.manifest import LabManifest  # noqa: E402
from toolkit.recipe.schema import WatchdogSpec  # noqa: E402
from toolkit.runs.timeline import read_lines  # noqa: E402
from toolkit.watch.progress import HangRule, RankProgress  # noqa: E402
from toolkit.watch.silence import QUIET_S  # noqa: E402

RECIPE = REPO / "recipes" / "tiny-lora-sft.yaml"
ALARMS = {"node_lost", "restart", "heartbeat_flood"}
SUITE_SUMMARY = re.compile(r"^=*\s*\d+ (?:passed|failed)\b.* in [\d.]+s\b", re.M)


def recipe_for(work: Path, minutes: float) -> Path:
    document = yaml.safe_load(RECIPE.read_text())
    for section, field in (("data", "train"), ("data", "eval"), ("eval", "golden")):  # written elsewhere
        if document.get(section, {}).get(field):
            document[section][field] = str(RECIPE.parent / document[section][field])
    document["training"]["steps"] = 1_000_000  # stopped by the benchmark, never finished
    hours, rest = divmod(int(minutes) + 15, 60)
    document["resources"]["time"] = f"{hours:02d}:{rest:02d}:00"
    assert "watchdog" not in document, "the shipped recipe's watchdog is the defaults: nothing set by hand"
    path = work / "false-alarms.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def step_margin(run_dir: Path) -> tuple[float, float, float]:
    """The highest (wait for a step) / (its hang limit) of rank 0 over the run, that wait, and the limit."""
    rule = HangRule.of(WatchdogSpec())
    worst = (0.0, 0.0, 0.0)
    rank: RankProgress | None = None
    for line in read_lines(run_dir / "metrics.jsonl", {"step": int, "time": (int, float)}):
        if rank is None or line["step"] <= rank.step:  # a new start (resumed from a checkpoint): a new clock
            rank = RankProgress(since=line["time"])
            rank.report("step", line["step"], line["time"])
            continue
        if rank.phase == "step" and rank.intervals:
            waited, limit = line["time"] - rank.since, rank.limit(rule)
            if waited / limit > worst[0]:
                worst = (waited / limit, waited, limit)
        rank.report("step", line["step"], line["time"])
    return worst


def load_beside(stop_at: float, log: Path) -> int:
    """The unit suite, again and again, until `stop_at`: the number of complete rounds."""
    rounds = 0
    with open(log, "a") as output:
        while time.monotonic() < stop_at:
            suite = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                                      "tests/unit"], cwd=REPO, stdout=output, stderr=subprocess.STDOUT)
            while suite.poll() is None and time.monotonic() < stop_at:
                time.sleep(1)
            if suite.poll() is None:
                suite.terminate()
                suite.wait()
            else:
                rounds += 1
    return rounds


def suite_rounds(log: Path) -> int:
    """Complete rounds of the unit suite in its log (pytest's last line: "... passed in 301.2s")."""
    try:
        return len(SUITE_SUMMARY.findall(log.read_text(errors="replace")))
    except OSError:
        return 0


def report(run_dir: Path, minutes: float, loaded: bool, rounds: int) -> dict:
    events = read_lines(run_dir / "events.jsonl", {"event": str})
    alarms = [e for e in events if e["event"] in ALARMS]
    gaps = [gap for e in events if e["event"] == "heartbeat_gaps" for gap in e.get("longest", {}).values()]
    steps = read_lines(run_dir / "metrics.jsonl", {"step": int})
    ratio, waited, limit = step_margin(run_dir)
    result = {"run_dir": str(run_dir), "minutes": minutes, "load": "unit suite" if loaded else "none",
              "suite_rounds": rounds, "steps": len(steps), "false_alarms": alarms,
              "longest_heartbeat_gap_s": max(gaps, default=None), "quiet_s": QUIET_S,
              "step_wait_over_limit": ratio, "step_wait_s": waited, "step_limit_s": limit}
    print(f"\n{minutes:.0f} min of training ({len(steps)} steps of rank 0), "
          f"{f'{rounds} complete rounds of the unit suite beside' if loaded else 'no load'}:")
    print(f"  false alarms: {len(alarms)}" + "".join(f"\n    {json.dumps(a)}" for a in alarms))
    if gaps:
        print(f"  longest heartbeat gap: {max(gaps):.2f} s (a node is probed after {QUIET_S:.1f} s of silence: "
              f"{QUIET_S / max(gaps):.1f}x margin)")
    print(f"  slowest step against its hang limit: {waited:.2f} s of {limit:.1f} s ({ratio:.2f}; a hang at 1.0)")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--no-load", action="store_true", help="the run alone (a baseline for the margins)")
    parser.add_argument("--report", type=Path, help="a run directory measured before: its figures only")
    args = parser.parse_args()
    if args.report:
        work = args.report.parents[1]
        events = read_lines(args.report / "events.jsonl", {"event": str, "time": (int, float)})
        metrics = read_lines(args.report / "metrics.jsonl", {"time": (int, float)})
        minutes = (metrics[-1]["time"] - events[0]["time"]) / 60 if metrics and events else 0
        rounds = suite_rounds(work / "suite.log")
        report(args.report, minutes, (work / "suite.log").exists(), rounds)
        return
    work = Path(tempfile.mkdtemp(prefix="ft-bench-false-alarms-", dir="/var/lib/ft-lab/shared"))
    manifest = LabManifest.load()
    store = manifest.object_store.env if manifest and manifest.object_store else {}
    # The lab's own object store (never a public endpoint): checkpoints are mirrored as in production.
    env = dict(os.environ, **store, FT_RUNS_DIR=str(work / "runs"), SLURM_CONF="/etc/slurm/slurm.conf")
    submitted = subprocess.run([sys.executable, "-m", "toolkit", "submit", "--json", "--skip-validation",
                                str(recipe_for(work, args.minutes))], env=env, cwd=REPO, capture_output=True,
                               text=True, check=True)
    run = json.loads(submitted.stdout)
    run_dir = Path(run["run_dir"])
    deadline = time.monotonic() + 600
    while not (run_dir / "metrics.jsonl").exists() and time.monotonic() < deadline:
        time.sleep(2)
    began = time.monotonic()
    stop_at = began + args.minutes * 60
    print(f"run {run['run_id']} (job {run['job_id']}) training; {args.minutes:.0f} min "
          f"{'alone' if args.no_load else 'beside the unit suite'}", flush=True)
    rounds = 0
    try:
        if args.no_load:
            time.sleep(max(stop_at - time.monotonic(), 0))
        else:
            rounds = load_beside(stop_at, work / "suite.log")
    finally:
        subprocess.run([sys.executable, "-m", "toolkit", "cancel", run["run_id"]], env=env, cwd=REPO,
                       capture_output=True)
    time.sleep(5)  # the supervisor's last events (the heartbeat gaps of the start it ends)
    result = report(run_dir, args.minutes, not args.no_load, rounds)
    (work / "results.json").write_text(json.dumps(result, indent=2))
    print(f"raw results: {work / 'results.json'}")


if __name__ == "__main__":
    main()
