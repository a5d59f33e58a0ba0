"""Benchmark recovery from a lost node on the lab, in one run (as root, with the lab up):

  slurm-native   the tiny 2-node LoRA run with ft's watchdog off: Slurm notices the dead node after
                 SlurmdTimeout, marks it DOWN and requeues the job (--requeue)
  ft-no-spare    the watchdog on: the node is noticed by its missing heartbeat and the job requeued
                 at once (or, the batch host lost, the other node reports it)
  ft-one-spare   the watchdog on, resources.spare_nodes 1: training goes on inside the same job
  ft-two-spares  the same with resources.spare_nodes 2 (goodput only: two crashes inside one job)

For each, --kills times (alternately the other node and the batch host's): a fresh run, a
crash of a node once training has passed its first checkpoint, then the seconds from the crash to
the first new training step (rank 0's stamped metrics), and the steps lost (the last step before
the crash minus the step training resumed from). The lab is healed after every crash (`ft lab up`).
Prints medians and the ratios to slurm-native (targets: <= 0.4x without a spare, <= 0.25x with one).

Then goodput (--goodput-steps > 0): the same recipe trained to the end once without faults, then in
each of --goodput-modes with a node crash every --crash-every seconds, alternately rank 0's node and
rank 1's: the training nodes (rank 0's is the batch host without a spare; with spares the batch host
waits as the last spare), each crashed node back once the run trains again: goodput as ft
counts it in `ft status` (steps trained for the first time over the wall time since the first
start; toolkit/runs/timeline.py), where the time went, and, beside it, the uninterrupted run's time
over the interrupted one's (target >= 0.85 at a crash every 90 s; slurm-native measured 0.57 on the
lab before ft).

Then a hung rank (--hangs times): rank 1 stopped with SIGSTOP, the seconds to the first new step
(target <= 20 s).

Every watchdog field is the recipe's default (toolkit/recipe/schema.py's WatchdogSpec): what a user
gets is what is measured.

    python benchmarks/recovery.py [--kills 5] [--hangs 3] [--goodput-steps 600]

The lab's SlurmdTimeout is 10 s, far kinder to slurm-native than a real cluster's 300 s default.
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

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from toolkit.lab import chaos, lifecycle  # noqa: E402
from toolkit.lab.manifest import LabManifest  # noqa: E402
from toolkit.runs.timeline import read_lines, timeline  # noqa: E402

RECIPE = REPO / "recipes" / "tiny-lora-sft.yaml"
MODES = {"slurm-native": {"watchdog": {"enabled": False}},
         "ft-no-spare": {"watchdog": {}},
         "ft-one-spare": {"watchdog": {}, "resources": {"spare_nodes": 1}},
         "ft-two-spares": {"watchdog": {}, "resources": {"spare_nodes": 2}}}
KILL_MODES = "slurm-native,ft-no-spare,ft-one-spare"
REBOOT_S = 60.0  # the longest a crashed node stays down in the goodput runs
GOODPUT_MODES = "ft-no-spare,ft-one-spare,ft-two-spares,slurm-native"


def ft(env: dict, *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "toolkit", *args], capture_output=True, text=True, env=env,
                          check=True, cwd=REPO).stdout


def goodput(env: dict, work: Path, args) -> dict:
    """Each run's goodput as ft itself counts it (toolkit/runs/timeline.py, what `ft status` shows):
    steps trained for the first time over the wall time since the first start. The uninterrupted
    run's own is the ceiling (its start and its end count too). Beside it, the uninterrupted run's
    time over the interrupted one's: a ratio of two runs, which the machine's noise moves (one
    run's steps 15% slower than another's was seen), so not the figure to judge by."""
    found = {}
    clean = goodput_run(env, recipe_for(work, "ft-no-spare", args.goodput_steps,
                                        global_batch=args.goodput_global_batch), None)
    print(f"\ngoodput, a crash every {args.crash_every:.0f} s ({args.goodput_steps} steps; uninterrupted: "
          f"goodput {clean['timeline']['goodput']:.2f}, {clean['seconds']:.0f} s from the first step to the end):",
          flush=True)
    for mode in args.goodput_modes.split(","):
        outcome = goodput_run(env, recipe_for(work, mode, args.goodput_steps,
                                              global_batch=args.goodput_global_batch),
                              args.crash_every)
        if outcome["seconds"] is None:  # the run failed: no goodput until someone resubmits it
            found[mode] = {**outcome, "goodput": 0.0}
            print(f"  {mode:14s} 0 (the run ended FAILED after {outcome['crashes']} crashes)", flush=True)
            continue
        spent = outcome["timeline"]
        found[mode] = {**outcome, "goodput": spent["goodput"], "relative": clean["seconds"] / outcome["seconds"]}
        print(f"  {mode:14s} {spent['goodput']:.2f} ({outcome['crashes']} crashes; wall {spent['wall_s']:.0f} s: "
              f"training {spent['productive_s']:.0f}, redone {spent['redone_s']:.0f}, starting "
              f"{spent['starting_s']:.0f}, recovering {spent['recovering_s']:.0f}, other {spent['other_s']:.0f}; "
              f"time relative to the uninterrupted run {found[mode]['relative']:.2f})", flush=True)
    return {"uninterrupted_seconds": clean["seconds"], "uninterrupted": clean["timeline"], **found}


def recipe_for(work: Path, mode: str, steps: int = 100_000, global_batch: int = 0) -> Path:
    document = yaml.safe_load(RECIPE.read_text())
    for section, field in (("data", "train"), ("data", "eval"), ("eval", "golden")):  # written elsewhere
        if document.get(section, {}).get(field):
            document[section][field] = str(RECIPE.parent / document[section][field])
    document["training"]["steps"] = steps  # the kill runs are stopped by the benchmark, never finished
    document["checkpoint"]["every_steps"] = 10
    # Every step's line written as it ends (the default writes ten at a time): the last step before
    # a crash is then on disk, and the steps lost can be counted.
    document.setdefault("tracking", {})["log_every_steps"] = 1
    for section, values in MODES[mode].items():
        document.setdefault(section, {}).update(values)
    if global_batch:  # more accumulation per step: a longer step (recovery's share of the time shows)
        document["training"]["global_batch"] = global_batch
    path = work / f"{mode}-{steps}-{global_batch or 'b'}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def metrics(run_dir: Path) -> list[dict]:
    return read_lines(run_dir / "metrics.jsonl", {"time": (int, float), "step": int})


def attempts(run_dir: Path) -> list[dict]:
    return read_lines(run_dir / "attempts.jsonl", {"started": (int, float)})


def wait(what: str, probe, timeout: float, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} did not happen within {timeout:.0f} s")


def stall(lines: list[dict], killed_at: float) -> dict:
    """The longest wait between two steps from the kill to 10 s after it, beside the run's median step."""
    times = [m["time"] for m in lines]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    near = [b - a for a, b in zip(times, times[1:], strict=False) if killed_at < b < killed_at + 10]
    return {"longest_gap_s": round(max(near), 2) if near else None,
            "median_step_s": round(statistics.median(gaps), 2) if gaps else None}


def took_over(run_dir: Path, after: float) -> dict | None:
    """A successor's take-over of the running step after `after` (events.jsonl), as a start at the crash."""
    for event in read_lines(run_dir / "events.jsonl", {"event": str, "time": (int, float)}):
        if event["event"] == "took_over" and event["time"] > after:
            return {"started": after, "successor": True}
    return None


def one_kill(env: dict, recipe: Path, batch_host: bool) -> dict:
    run = json.loads(ft(env, "submit", "--json", "--skip-validation", str(recipe)))
    run_dir = Path(run["run_dir"])
    try:
        wait("the first checkpoint", lambda: (run_dir / "checkpoints" / "latest").exists(), 300)
        time.sleep(2)  # a few steps past it: some work to lose
        before = metrics(run_dir)
        killed_at = time.time()
        if batch_host:  # rank 0's node without a spare; with one, the spare itself (supervise.py)
            chaos.crash_batch_host(run_dir)
        else:
            chaos.crash_rank_node(run_dir, 1)  # a training node that is not the batch host
        # The first step of the next start (the launchers' attempts.jsonl, watchdog or not); with a
        # spare, the batch host trains on no rank, and a successor takes over the running training
        # step (toolkit/launch/handover.py): the first step after the crash, with nothing restarted.
        restarted = wait("the start after the crash, or a successor's take-over", lambda: next(
            (a for a in attempts(run_dir) if a["started"] > killed_at), None) or took_over(run_dir, killed_at), 600)
        first = wait("the first step after the crash",
                     lambda: next((m for m in metrics(run_dir) if m["time"] > restarted["started"]), None), 600)
        if restarted.get("successor"):  # how long training paused, if at all: steps until 10 s after the kill
            wait("10 s of training after the crash",
                 lambda: any(m["time"] > killed_at + 10 for m in metrics(run_dir)), 120)
        resumed = [m for m in metrics(run_dir) if m["time"] > restarted["started"]]
        # Never below 0: with a spare the batch host trains on no rank, and the others' steps (and
        # checkpoints) went on after its crash until the requeue.
        return {"seconds": first["time"] - killed_at,
                "steps_lost": max(before[-1]["step"] - (resumed[0]["step"] - 1), 0),
                "victim": "batch host" if batch_host else "other node",
                "succeeded": bool(restarted.get("successor")), **stall(metrics(run_dir), killed_at)}
    finally:
        subprocess.run([sys.executable, "-m", "toolkit", "cancel", run["run_id"]], env=env, capture_output=True,
                       cwd=REPO)
        time.sleep(2)
        lifecycle.up()


def one_hang(env: dict, recipe: Path) -> dict:
    """A rank stopped (SIGSTOP) once training has passed its first checkpoint: the seconds from the
    stop to the first new training step (the watchdog's hang rule, the stacks dumped, the restart)."""
    run = json.loads(ft(env, "submit", "--json", "--skip-validation", str(recipe)))
    run_dir = Path(run["run_dir"])
    try:
        wait("the first checkpoint", lambda: (run_dir / "checkpoints" / "latest").exists(), 300)
        time.sleep(2)
        before = metrics(run_dir)
        stopped_at = time.time()
        chaos.hang_rank(run_dir, 1)
        first = wait("the first step after the hang",
                     lambda: next((m for m in metrics(run_dir) if m["time"] > stopped_at + 0.5), None), 600)
        return {"seconds": first["time"] - stopped_at, "steps_lost": before[-1]["step"] - (first["step"] - 1)}
    finally:
        subprocess.run([sys.executable, "-m", "toolkit", "cancel", run["run_id"]], env=env, capture_output=True,
                       cwd=REPO)
        time.sleep(2)


def first_step_to_end(run_dir: Path) -> float:
    lines = metrics(run_dir)
    return lines[-1]["time"] - lines[0]["time"]


def job_alive(job_id: str) -> bool:
    """Still queued, running or requeued (squeue lists it)."""
    listed = subprocess.run(["squeue", "--noheader", "--jobs", str(job_id), "--format", "%i"], capture_output=True,
                            text=True)
    return listed.returncode == 0 and bool(listed.stdout.strip())


def heal(env: dict) -> subprocess.Popen:
    """`ft lab up` in the background: the crashed node back."""
    return subprocess.Popen([sys.executable, "-m", "toolkit", "lab", "up"], env=env, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def goodput_run(env: dict, recipe: Path, crash_every: float | None) -> dict:
    """Train to the end, crashing a node every `crash_every` seconds of the run (None: never)."""
    run = json.loads(ft(env, "submit", "--json", "--skip-validation", str(recipe)))
    run_dir = Path(run["run_dir"])
    crashes, healing, crashed_at = 0, None, None
    wait("the first step", lambda: metrics(run_dir), 300)
    last = time.monotonic()
    while not (run_dir / "done").exists():
        time.sleep(1)
        if not job_alive(run["job_id"]) and not (run_dir / "done").exists():
            return {"seconds": None, "crashes": crashes}  # ended unfinished: a user would resubmit by hand
        if crashed_at is not None and (time.time() - crashed_at > REBOOT_S
                                       or any(m["time"] > crashed_at + 0.5 for m in metrics(run_dir))):
            # A crashed node comes back (`ft lab up` starts its slurmd again) once the run trains
            # again, or after REBOOT_S (a requeued job may want every node of the lab): a real node
            # takes minutes to reboot. Brought back at once, its slurmd answers before the loss is
            # judged, and Slurm, not ft, handles it.
            healing, crashed_at = heal(env), None
        if crash_every is None or time.monotonic() - last < crash_every:
            continue
        if crashed_at is not None or (healing is not None and healing.poll() is None):
            continue  # the last crashed node is not back yet
        try:
            chaos.crash_rank_node(Path(run["run_dir"]), crashes % 2)
        except Exception:  # noqa: BLE001 - between two starts: no rank to crash yet, try again
            continue
        crashes, last, crashed_at = crashes + 1, time.monotonic(), time.time()
    if crashed_at is not None:
        healing = heal(env)
    wait("the run's end", lambda: (run_dir / "summary.json").exists(), 120)
    if healing is not None:
        healing.wait()
    return {"seconds": first_step_to_end(run_dir), "crashes": crashes, "timeline": timeline(run_dir)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--modes", default=KILL_MODES, help="the modes of the kill measurements")
    parser.add_argument("--victims", choices=("alternate", "batch-host", "other"), default="alternate",
                        help="which node each kill crashes: the other node and the batch host in turn, or one of them")
    parser.add_argument("--goodput-modes", default=GOODPUT_MODES)
    parser.add_argument("--hangs", type=int, default=3)
    parser.add_argument("--goodput-steps", type=int, default=600)
    parser.add_argument("--crash-every", type=float, default=90.0)
    parser.add_argument("--goodput-global-batch", type=int, default=128,
                        help="the goodput runs' global batch: 128 makes a lab step about 0.5 s")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ft-bench-recovery-", dir="/var/lib/ft-lab/shared"))
    manifest = LabManifest.load()
    store = manifest.object_store.env if manifest and manifest.object_store else {}
    # The lab's own object store (never a public endpoint): checkpoints are mirrored as in production.
    env = dict(os.environ, **store, FT_RUNS_DIR=str(work / "runs"), SLURM_CONF="/etc/slurm/slurm.conf")
    results: dict[str, list[dict]] = {}
    for mode in args.modes.split(","):
        recipe = recipe_for(work, mode)
        results[mode] = []
        for kill in range(args.kills):
            batch_host = kill % 2 == 1 if args.victims == "alternate" else args.victims == "batch-host"
            outcome = one_kill(env, recipe, batch_host)  # alternating: the other node first, then the batch host
            results[mode].append(outcome)
            print(f"{mode}: kill {kill + 1}: {outcome['seconds']:.1f} s to the first new step, "
                  f"{outcome['steps_lost']} steps lost ({outcome['victim']}"
                  + (f"; a successor took over, training went on: longest wait between steps "
                     f"{outcome['longest_gap_s']} s, median step {outcome['median_step_s']} s"
                     if outcome["succeeded"] else "") + ")", flush=True)
    if args.kills:
        native = statistics.median(r["seconds"] for r in results.get("slurm-native", [])) \
            if results.get("slurm-native") else None
        print(f"\nkill -> first new step (median of {args.kills}; the watchdog's defaults):")
        for mode, outcomes in results.items():
            median = statistics.median(r["seconds"] for r in outcomes)
            spread = f"{min(r['seconds'] for r in outcomes):.1f}-{max(r['seconds'] for r in outcomes):.1f}"
            lost = max(r["steps_lost"] for r in outcomes)
            ratio = f"  {median / native:.2f}x slurm-native" if native else ""
            print(f"  {mode:14s} {median:6.1f} s ({spread}), at most {lost} steps lost{ratio}")
    if args.hangs:
        recipe = recipe_for(work, "ft-no-spare")
        results["hang"] = [one_hang(env, recipe) for _ in range(args.hangs)]
        for number, outcome in enumerate(results["hang"], 1):
            print(f"hung rank {number}: {outcome['seconds']:.1f} s to the first new step, {outcome['steps_lost']} "
                  "steps lost", flush=True)
        print(f"  a hung rank: back to training in {statistics.median(r['seconds'] for r in results['hang']):.1f} s "
              "(median; target <= 20 s)")
    if args.goodput_steps:
        results["goodput"] = goodput(env, work, args)
    (work / "results.json").write_text(json.dumps(results, indent=2))
    print(f"raw results: {work / 'results.json'}")


if __name__ == "__main__":
    main()
