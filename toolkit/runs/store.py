"""Run directories. Layout of <runs root>/<run id>/:

    run.json           what ft knows: recipe, cluster, idempotency key, every Slurm job id
    recipe.yaml        the recipe as submitted;  recipe.resolved.yaml  with every default filled
    job.sbatch         the exact script Slurm runs (it also writes recipe.json when it starts)
    attempts.jsonl     one line per start of the job (requeues included), from the launcher
    logs/              slurm-<job>.out, node-<node>.log, rank-<rank>.log
    checkpoints/       written by the training runtime
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import re
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from toolkit.base.errors import FtError, UsageError
from toolkit.base.names import RUN_ID_PATTERN
from toolkit.base.shared_dirs import common_dir, flock_within, private_dir, write_atomically
from toolkit.runs.layout import RunLayout, read_private_file

KEY_PATTERN = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
_ID_ALPHABET = "abcdefghjkmnpqrstuvwxyz23456789"  # no 0/o/1/l/i: ids are typed by people


@dataclass
class JobRecord:
    job_id: str
    submitted: float


@dataclass
class RunRecord:
    run_id: str
    recipe_name: str
    recipe_path: str
    cluster: str
    mode: str
    created: float
    idempotency_key: str | None = None
    jobs: list[JobRecord] = field(default_factory=list)

    @property
    def latest_job(self) -> str | None:
        return self.jobs[-1].job_id if self.jobs else None


class RunNotFound(FtError):
    exit_code = 2


def new_run_id(recipe_name: str) -> str:
    """Eight random letters: in a runs root every user can write to, nobody can take the ids a
    user's next runs will get (31^8 of them a day)."""
    suffix = "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))
    return f"{recipe_name}-{time.strftime('%Y%m%d')}-{suffix}"


def validate_key(key: str) -> str:
    if not KEY_PATTERN.fullmatch(key):
        raise UsageError(f"idempotency key {key!r} is not usable",
                         hint="use 1-128 letters, digits and . _ : @ / + = - (it is stored on the Slurm job)")
    return key


class RunStore:
    def __init__(self, root: Path, common: bool = False):
        self.root = root
        self.common = common  # every user of the cluster keeps runs here (the shared root's runs/)

    @classmethod
    def for_shared_root(cls, shared_root: str) -> RunStore:
        if os.environ.get("FT_RUNS_DIR"):
            return cls(Path(os.environ["FT_RUNS_DIR"]))
        return cls(Path(os.path.expanduser(shared_root or "~/ft")) / "runs", common=bool(shared_root))

    def folder(self, path: Path) -> Path:
        """A folder of the store that holds other folders: common to all users in a common store."""
        if self.common:
            return common_dir(path)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def run_dir(self, run_id: str) -> Path:
        """The folder of a run. The id is checked first: one typed on a command line or read from
        disk never leads outside the runs root (`ft status ../x`)."""
        if not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id) or run_id in (".", ".."):
            raise UsageError(f"{run_id!r} is not a run id",
                             hint="run ids are letters, digits, '.', '_' and '-' (see `ft ls`)")
        return self.root / run_id

    def claim_run_dir(self, recipe_name: str, attempts: int = 5) -> str:
        """A new run id, with its folder made: an id someone else's folder holds is never used."""
        for _ in range(attempts):
            run_id = new_run_id(recipe_name)
            try:
                self.create_run_dir(run_id)
            except FileExistsError:
                continue
            return run_id
        raise FtError(f"{attempts} new run ids in {self.root} were all taken by folders already there",
                      hint=f"someone is filling {self.root}: tell the cluster's admins")

    def create_run_dir(self, run_id: str, exist_ok: bool = False) -> Path:
        """A run's folder and its logs folder, private to the submitting user: its data report,
        recipe and logs are theirs alone. The runs root is common to every user of the cluster.
        Slurm opens the job's log before the script runs, so the logs folder exists before any sbatch."""
        run_dir = self.run_dir(run_id)
        self.folder(self.root)
        if exist_ok:  # an existing folder is used only when it is this user's alone
            private_dir(run_dir)
            private_dir(RunLayout(run_dir).logs)
        else:
            run_dir.mkdir(mode=0o700)
            RunLayout(run_dir).logs.mkdir(mode=0o700)
        return run_dir

    def save(self, record: RunRecord) -> None:
        write_atomically(RunLayout(self.run_dir(record.run_id)).record, json.dumps(asdict(record), indent=2) + "\n")

    def add_job(self, run_id: str, job: JobRecord, adopt: Callable[[], RunRecord] | None = None) -> RunRecord:
        """Add a job to a run's record, once (a requeued job keeps its id), under the run's lock: a
        job registers itself as it starts (toolkit/runs/register.py) while `ft submit` records
        it. `adopt`: the record of a run that has none yet (a script submitted with plain sbatch)."""
        layout = RunLayout(self.run_dir(run_id))
        with locked(layout.record_lock):
            record = adopt() if adopt is not None and not layout.record.exists() else self.load(run_id)
            if job.job_id not in {known.job_id for known in record.jobs}:
                record.jobs.append(job)
                self.save(record)
            return record

    def placeholder(self, record: RunRecord) -> None:
        """The record of a rendered run no job has joined yet (`ft render -o`): written unless a
        job has (a render again of the same run id describes it anew)."""
        layout = RunLayout(self.run_dir(record.run_id))
        with locked(layout.record_lock):
            if layout.record.exists() and self.load(record.run_id).jobs:
                return
            self.save(record)

    def load(self, run_id: str) -> RunRecord:
        path = RunLayout(self.run_dir(run_id)).record
        try:
            raw = json.loads(read_private_file(path))
        except FileNotFoundError:
            known = [r.run_id for r in self.list()][:5]
            raise RunNotFound(f"no run {run_id!r} in {self.root}",
                              hint=("recent runs: " + ", ".join(known)) if known else "see `ft ls`") from None
        except (OSError, ValueError) as exc:
            raise RunNotFound(f"{path} is unreadable ({exc})", hint="the run's record is damaged") from None
        try:
            raw["jobs"] = [JobRecord(**job) for job in raw.get("jobs", [])]
            record = RunRecord(**raw)
        except (TypeError, AttributeError) as exc:
            raise RunNotFound(f"{path} is not a run record ({exc})", hint="the run's record is damaged") from None
        if record.run_id != run_id:
            raise RunNotFound(f"{path} names run {record.run_id!r}, not {run_id!r}",
                              hint="the run's record was copied or changed by hand")
        return record

    def list(self) -> list[RunRecord]:
        records = []
        if self.root.is_dir():
            for path in self.root.iterdir():
                with contextlib.suppress(FtError, OSError, ValueError, TypeError):
                    records.append(self.load(path.name))
        return sorted(records, key=lambda record: record.created, reverse=True)

    # -- idempotency -------------------------------------------------------------------------
    def _key_path(self, key: str, suffix: str) -> Path:
        """Keys are per user: the same key from another user is another key, and a user's key index
        is private (another user's index file there could send their submit to a planted run)."""
        digest = hashlib.sha256(key.encode()).hexdigest()[:32]
        return private_dir(self.folder(self.root / ".keys") / f"uid-{os.getuid()}") / f"{digest}.{suffix}"

    def key_lock(self, key: str):
        """Exclusive across processes and shells (flock on the shared filesystem)."""
        return locked(self._key_path(key, "lock"), wait_s=math.inf)  # held while the data is checked

    def run_for_key(self, key: str) -> str | None:
        try:
            entry = json.loads(self._key_path(key, "json").read_text())
            run_id = entry["run_id"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        # An index entry is only a pointer: one that is malformed or names another key is ignored.
        if entry.get("key") != key or not isinstance(run_id, str) or not RUN_ID_PATTERN.fullmatch(run_id):
            return None
        return run_id

    def remember_key(self, key: str, run_id: str) -> None:
        write_atomically(self._key_path(key, "json"), json.dumps({"key": key, "run_id": run_id}) + "\n")


LOCK_WAIT_S = 30.0


@contextlib.contextmanager
def locked(path: Path, wait_s: float | None = None):
    """Exclusive across processes, shells and nodes (flock on the shared filesystem), for at most
    `wait_s` seconds of waiting (TimeoutError after): a stuck holder never holds a job or a command
    forever. The lock file is a regular file of this user's: never a symlink or a FIFO planted there."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
    with os.fdopen(descriptor, "a") as handle:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise OSError(f"{path} is not a lock file of yours")
        flock_within(descriptor, path, LOCK_WAIT_S if wait_s is None else wait_s)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
