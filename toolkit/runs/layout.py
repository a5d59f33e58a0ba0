"""What a run directory holds, named once for both sides: the login side (`ft submit`, `ft status`,
`ft logs`), the job script, the launchers, the watchdog and the ranks.

    run.json          the run's record: id, recipe, cluster, jobs (RunStore; .run.lock guards it)
    recipe.yaml       the recipe as submitted; recipe.resolved.yaml, with every default filled
    job.sbatch        the rendered job script, as submitted
    data-report.json  what `ft submit`'s data checks found
    submitit/         submitit's own files of the submission
    recipe.json       the resolved recipe and what follows from it (RunSpec), written by the job
                      script from the copy inside it
    attempts.jsonl    one line per start of the job: its nodes, when
    events.jsonl      the watchdog's events: nodes lost, restarts (what `ft status` counts as faults)
    exit-status       why the current step ended (toolkit/watch/exits.py)
    done              the run finished: a requeue after it never reruns it
    metrics.jsonl     every step's loss, learning rate, tokens (rank 0)
    tracking.json     where else the metrics went (W&B page or offline folder)
    summary.json      what the finished run did and cost
    eval-base.json    the base model's evaluation, measured before the first step
    eval.json         the trained model's evaluation beside the base's, the gates, and the verdict
    plan.json         where `ft submit --cluster auto` put the run, and why (the options it weighed)
    receipt.jsonl     the run's receipt: hash-linked entries of what it used and made (.receipt.lock
                      serializes its appends); receipt.sig, the site signer's signature over it
    checkpoints/      the checkpoints, unless the recipe stages them elsewhere
    output/           the adapter or the weights, with the tokenizer
    logs/             slurm-<job>.out, node-<host>.log, rank-<n>.log, warm-<host>.log, stacks/
    ranks/            <n>.json: where each rank runs now (node, process id; its launcher writes it)
    launch/           the launchers' start marks, per start of the job
    preflight/        what each node saw in a preflight job
    cache/            the run's own cache, when the user's shared one may not be used

Only this module spells these names; everything else asks a RunLayout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.errors import FtError

if TYPE_CHECKING:
    from toolkit.recipe.run_spec import RunSpec

RECORD = "run.json"
RECORD_LOCK = ".run.lock"
RECIPE_SOURCE = "recipe.yaml"
RECIPE_RESOLVED = "recipe.resolved.yaml"
SCRIPT = "job.sbatch"
DATA_REPORT = "data-report.json"
SUBMITIT = "submitit"
SPEC = "recipe.json"
ATTEMPTS = "attempts.jsonl"
EVENTS = "events.jsonl"
EXIT_STATUS = "exit-status"
DONE = "done"
METRICS = "metrics.jsonl"
TRACKING = "tracking.json"
SUMMARY = "summary.json"
EVAL_BASE = "eval-base.json"
EVALUATION = "eval.json"
CHECKPOINTS = "checkpoints"
CHECKPOINT_STATUS = "checkpoints.json"
OUTPUT = "output"
PLAN = "plan.json"
LOGS = "logs"
LAUNCH_MARKS = "launch"
LAUNCH_FAILURES = "launch-failures"
PREFLIGHT = "preflight"
CACHE = "cache"
RANKS = "ranks"
RECEIPT = "receipt.jsonl"
RECEIPT_LOCK = ".receipt.lock"
RECEIPT_SIGNATURE = "receipt.sig"

# A run id names a folder and a Slurm comment, and is typed by users: plain characters only.
RUN_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,100}$")

# What the job script needs, by the names its template uses.
TEMPLATE_NAMES = {"spec": SPEC, "exit_status": EXIT_STATUS, "done": DONE, "logs": LOGS,
                  "launch_marks": LAUNCH_MARKS, "launch_failures": LAUNCH_FAILURES,
                  "checkpoint_status": CHECKPOINT_STATUS}


MAX_SPEC_BYTES = 16 << 20  # a recipe's env may carry values up to 128 KiB each


class RunSpecError(FtError):
    """The run spec a job reads is missing or damaged: no restart can help (exit 4, not requeued)."""

    exit_code = 4

    def __init__(self, message: str):
        super().__init__(message, hint="render the job script again (ft render / ft submit); "
                                       "edit the recipe, not the JSON inside the script")


@dataclass(frozen=True)
class RunLayout:
    root: Path

    @property
    def record(self) -> Path:
        return self.root / RECORD

    @property
    def record_lock(self) -> Path:
        return self.root / RECORD_LOCK

    @property
    def recipe_source(self) -> Path:
        return self.root / RECIPE_SOURCE

    @property
    def recipe_resolved(self) -> Path:
        return self.root / RECIPE_RESOLVED

    @property
    def script(self) -> Path:
        return self.root / SCRIPT

    @property
    def data_report(self) -> Path:
        return self.root / DATA_REPORT

    @property
    def submitit(self) -> Path:
        return self.root / SUBMITIT

    @property
    def spec(self) -> Path:
        return self.root / SPEC

    @property
    def attempts(self) -> Path:
        return self.root / ATTEMPTS

    @property
    def events(self) -> Path:
        return self.root / EVENTS

    @property
    def exit_status(self) -> Path:
        return self.root / EXIT_STATUS

    @property
    def done(self) -> Path:
        return self.root / DONE

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def tracking(self) -> Path:
        return self.root / TRACKING

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY

    @property
    def eval_base(self) -> Path:
        return self.root / EVAL_BASE

    @property
    def evaluation(self) -> Path:
        """The evaluation after training, its gates and verdict (toolkit/evaluate/)."""
        return self.root / EVALUATION

    @property
    def plan(self) -> Path:
        """Where `ft submit --cluster auto` put the run, and why (toolkit/cluster/broker.py)."""
        return self.root / PLAN

    @property
    def receipt(self) -> Path:
        """The run's hash-linked receipt (toolkit/receipts/chain.py)."""
        return self.root / RECEIPT

    @property
    def receipt_lock(self) -> Path:
        return self.root / RECEIPT_LOCK

    @property
    def receipt_signature(self) -> Path:
        return self.root / RECEIPT_SIGNATURE

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def checkpoint_status(self) -> Path:
        """Where each checkpoint tier stands (toolkit/checkpoint/status.py)."""
        return self.root / CHECKPOINT_STATUS

    @property
    def launch_marks(self) -> Path:
        """A folder per start of the step: its launchers' marks and srun's messages (toolkit/job)."""
        return self.root / LAUNCH_MARKS

    @property
    def launch_failures(self) -> Path:
        """Each loss of nodes under the run, with its checkpoint step (toolkit/job/losses.py)."""
        return self.root / LAUNCH_FAILURES

    @property
    def output(self) -> Path:
        return self.root / OUTPUT

    @property
    def logs(self) -> Path:
        return self.root / LOGS

    @property
    def stacks(self) -> Path:
        return self.logs / "stacks"

    @property
    def preflight(self) -> Path:
        return self.root / PREFLIGHT

    @property
    def cache(self) -> Path:
        return self.root / CACHE

    def node_log(self, node: str) -> Path:
        return self.logs / f"node-{node}.log"

    def rank_place(self, rank: int) -> Path:
        return self.root / RANKS / f"{rank}.json"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank-{rank}.log"

    def slurm_log(self, job_id: str) -> Path:
        return self.logs / f"slurm-{job_id}.out"

    def read_spec(self) -> RunSpec:
        """The job's typed recipe and derived values. RunSpecError, naming the file and the fix, when
        it is missing, not a regular file of this user's, over 16 MiB, or does not add up."""
        from pydantic import ValidationError

        from toolkit.recipe.run_spec import RunSpec
        from toolkit.runs.store import read_private_file

        try:
            return RunSpec.model_validate_json(read_private_file(self.spec, limit=MAX_SPEC_BYTES))
        except OSError as exc:
            raise RunSpecError(f"{self.spec} is unreadable: {exc}") from None
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, error['loc'])) or 'the file'}: "
                                 f"{error['msg'].removeprefix('Value error, ')}" for error in exc.errors()[:5])
            raise RunSpecError(f"{self.spec} does not hold a usable run spec: {problems}") from None
