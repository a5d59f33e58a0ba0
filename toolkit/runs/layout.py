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
    exit-status       why the current step ended (toolkit/runs/exits.py)
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

import contextlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.base.errors import FtError
from toolkit.runs import exits

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
# In logs/: one per Slurm job (sbatch's %j), per node (srun's %N), per rank, per node's warm template.
SLURM_LOG = "slurm-{job}.out"
NODE_LOG = "node-{node}.log"
RANK_LOG = "rank-{rank}.log"
WARM_LOG = "warm-{node}.log"
WARM_SRUN_ERRORS = "warm-srun.err"
SUCCESSOR_SRUN_ERRORS = "successor-srun-{node}.err"  # srun's messages for a successor started from a node
STACKS = "stacks"
STACK_DUMP = "rank-{rank}.{stamp}.txt"  # in stacks/: a hung rank's threads, per job and start
# In launch/, a folder per start of the step (FT_LAUNCH_MARKS), named by the job, its restart, the
# batch host it came after (a successor's) and the launch: srun's messages, the nodes an older job
# script requeues without, the step's srun command and the nodes left out (for a successor), the
# one claim to succeed a lost batch host, and where its successor listens; the survivors' word that
# the batch host is lost (the first to leave it reports), and that its reporter had the job requeued.
START_MARKS = "{job}.{restart}{after}.{launch}"
SRUN_ERRORS = "srun.err"
LOST_NODES = "lost-nodes"
STEP_COMMAND = "step.json"
EXCLUDED = "excluded.json"
SUCCESSION = "succession-of-{node}"
SUCCESSOR = "successor-of-{node}.json"
BATCH_HOST_LOST = "lost-{node}"
REQUEUED_FOR = "requeued-{node}"
WANDB = "wandb"  # W&B's own folder (wandb.init(dir=<run dir>)): offline runs wait there for `ft sync`
REPORT = "report.html"  # `ft report`'s page, unless -o says elsewhere


# What the job script needs, by the names its template uses.
TEMPLATE_NAMES = {"spec": SPEC, "exit_status": EXIT_STATUS, "done": DONE, "logs": LOGS,
                  "launch_marks": LAUNCH_MARKS, "launch_failures": LAUNCH_FAILURES,
                  "checkpoint_status": CHECKPOINT_STATUS, "slurm_log": SLURM_LOG.format(job="%j")}


MAX_SPEC_BYTES = 16 << 20  # a recipe's env may carry values up to 128 KiB each


class RunSpecError(FtError):
    """The run spec a job reads is missing or damaged: no restart can help (a user error, not requeued)."""

    exit_code = exits.USER_ERROR

    def __init__(self, message: str):
        super().__init__(message, hint="render the job script again (ft render / ft submit); "
                                       "edit the recipe, not the JSON inside the script")


MAX_RECORD_BYTES = 1 << 20


def read_private_file(path: Path, limit: int = MAX_RECORD_BYTES) -> str:
    """A file of this user's run: its folder must be theirs (anyone may make a folder in a common
    runs root, with a record claiming anything), the file a regular one of bounded size (never a
    FIFO that blocks, a symlink, or /dev/zero)."""
    folder = os.lstat(path.parent)
    if not stat.S_ISDIR(folder.st_mode) or folder.st_uid != os.getuid():
        raise OSError(f"{path.parent} is not a run folder of yours")
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            raise OSError(f"{path} is not a run record (not a regular file, or over {limit >> 20} MiB)")
        return handle.read(limit + 1).decode(errors="replace")


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

    def start_marks(self, job_id: str, restart: int, launch: int, after: str | None = None) -> Path:
        """The folder of one start of the step (`after`: the lost batch host a successor's start
        follows)."""
        return self.launch_marks / START_MARKS.format(job=job_id, restart=restart, launch=launch,
                                                      after=f".after-{after}" if after else "")

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
        return self.logs / STACKS

    @property
    def preflight(self) -> Path:
        return self.root / PREFLIGHT

    @property
    def cache(self) -> Path:
        return self.root / CACHE

    def node_log(self, node: str) -> Path:
        """A node's launcher log; node "%N" is srun's pattern for it."""
        return self.logs / NODE_LOG.format(node=node)

    def stack_dump(self, rank: int, stamp: str) -> Path:
        return self.stacks / STACK_DUMP.format(rank=rank, stamp=stamp)

    def successor_srun_errors(self, node: str) -> Path:
        return self.logs / SUCCESSOR_SRUN_ERRORS.format(node=node)

    @property
    def wandb(self) -> Path:
        return self.root / WANDB

    @property
    def report(self) -> Path:
        return self.root / REPORT

    def warm_log(self, node: str) -> Path:
        return self.logs / WARM_LOG.format(node=node)

    @property
    def warm_srun_errors(self) -> Path:
        return self.logs / WARM_SRUN_ERRORS

    def rank_place(self, rank: int) -> Path:
        return self.root / RANKS / f"{rank}.json"

    def rank_log(self, rank: int) -> Path:
        return self.logs / RANK_LOG.format(rank=rank)

    def slurm_log(self, job_id: str) -> Path:
        return self.logs / SLURM_LOG.format(job=job_id)

    def leave_exit_status(self, status: int) -> None:
        """Say why this step ends, for the supervisor and the job (toolkit/runs/exits.py; written
        whole: renamed in)."""
        staged = self.exit_status.with_name(f".{self.exit_status.name}.{os.getpid()}")
        staged.write_text(f"{status}\n")
        staged.replace(self.exit_status)

    def read_exit_status(self) -> int | None:
        try:
            text = self.exit_status.read_text(errors="replace").strip()
        except OSError:
            return None
        return int(text) if text.isascii() and text.isdigit() and len(text) <= 3 else None

    def clear_exit_status(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.exit_status.unlink()

    def read_spec(self) -> RunSpec:
        """The job's typed recipe and derived values. RunSpecError, naming the file and the fix, when
        it is missing, not a regular file of this user's, over 16 MiB, or does not add up."""
        from pydantic import ValidationError

        from toolkit.recipe.run_spec import RunSpec

        try:
            return RunSpec.model_validate_json(read_private_file(self.spec, limit=MAX_SPEC_BYTES))
        except OSError as exc:
            raise RunSpecError(f"{self.spec} is unreadable: {exc}") from None
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, error['loc'])) or 'the file'}: "
                                 f"{error['msg'].removeprefix('Value error, ')}" for error in exc.errors()[:5])
            raise RunSpecError(f"{self.spec} does not hold a usable run spec: {problems}") from None
