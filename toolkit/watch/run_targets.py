"""Which runs Prometheus scrapes, and under whose name: the runs' claims, checked against Slurm.

A run's watchdog says where it serves its metrics with a claim, <claims>/<run>.<job id>.json
(toolkit/watch/metrics.RunExporter), in a folder every user of the cluster writes (like runs/).
Whatever such a file says, anyone could have written it, so Prometheus never reads it. The cluster
exporter (toolkit/watch/cluster_metrics, as its own unprivileged user) publishes a claim only when

  - Slurm runs the job the file names, a job of ft's (its comment names the run: ft-run=<run>),
  - the file's owner is the job's user (a file is owned by whoever made it; nobody can give theirs away),
  - the address is the job's batch host (where its watchdog runs) and a port,

and labels it with Slurm's word: run (the job's comment), user, slurm_job. Prometheus reads only the
published file, in a folder only the exporter writes. A run's own metrics carry none of these labels:
a user's process may serve anything, but only ever under its own user, job and run.

A claim whose job has ended is not published (a watchdog lost with its batch host leaves its file).
"""

from __future__ import annotations

import json
import os
import pwd
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from toolkit.shared_dirs import write_atomically

CLAIM_MAX_BYTES = 4096  # a claim is one address; anything larger is not one of ours
PUBLISHED_NAME = "runs.json"
# Slurm's word on its running jobs. JobID in --Format is each array element's own id (SLURM_JOB_ID, as
# its watchdog names the claim). A field with no size is printed whole (a size would pad it).
SQUEUE_RUNNING = ["squeue", "--all", "--noheader", "--states=RUNNING",
                  "--Format=JobID:|,UserName:|,BatchHost:|,Comment:|"]
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
PORT = re.compile(r"[0-9]{1,5}")


@dataclass(frozen=True)
class RunningJob:
    job_id: str
    user: str
    batch_host: str
    run: str  # from the job's comment: ft-run=<run>


@dataclass(frozen=True)
class Refusal:
    claim: str
    why: str


def parse_running(text: str) -> dict[str, RunningJob]:
    """ft's running jobs in SQUEUE_RUNNING's lines."""
    jobs = {}
    for line in text.splitlines():
        parts = [part.strip() for part in line.split("|", 3)]
        if len(parts) < 4 or not parts[0].isdigit():
            continue
        fields = dict(item.split("=", 1) for item in parts[3].rstrip("|").strip().split(",") if "=" in item)
        run = fields.get("ft-run", "")
        if RUN_NAME.fullmatch(run):
            jobs[parts[0]] = RunningJob(parts[0], parts[1], parts[2], run)
    return jobs


def read_claim(path: Path, job: RunningJob) -> str:
    """The claim's address (host:port), or ValueError saying why it is not published."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a link or a FIFO: refused
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a plain file")
        owner = user_name(info.st_uid)
        if owner != job.user:
            raise ValueError(f"owned by {owner}, while job {job.job_id} is {job.user}'s")
        content = handle.read(CLAIM_MAX_BYTES + 1)
    if len(content) > CLAIM_MAX_BYTES:
        raise ValueError(f"larger than {CLAIM_MAX_BYTES} bytes")
    try:
        groups = json.loads(content)
        (address,) = groups[0]["targets"]
        host, port = address.rsplit(":", 1)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
        raise ValueError(f"not one host:port in file_sd's format ({error})") from None
    if host != job.batch_host:
        raise ValueError(f"names host {host!r}; job {job.job_id} runs its watchdog on {job.batch_host}")
    if not PORT.fullmatch(port) or not 0 < int(port) < 65536:
        raise ValueError(f"names port {port!r}")
    return f"{host}:{int(port)}"


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def verified_targets(claims: Path, jobs: dict[str, RunningJob]) -> tuple[list[dict], list[Refusal]]:
    """file_sd groups for the claims Slurm vouches for, and why each other claim of a running job is not
    published (a claim of a job that is not running is ignored: it is the normal end of a lost run)."""
    groups, refusals = [], []
    for path in sorted(claims.glob("*.json")):
        job = jobs.get(path.name[:-len(".json")].rsplit(".", 1)[-1])
        if job is None:
            continue
        try:
            address = read_claim(path, job)
        except (OSError, ValueError) as error:
            refusals.append(Refusal(path.name, str(error)))
            continue
        groups.append({"targets": [address], "labels": {"run": job.run, "user": job.user, "slurm_job": job.job_id}})
    return groups, refusals


def publish(folder: Path, groups: list[dict]) -> bool:
    """Write the published file when what it says changed (Prometheus re-reads it on change)."""
    path = folder / PUBLISHED_NAME
    text = json.dumps(groups, indent=1, sort_keys=True) + "\n"
    try:
        if path.read_text() == text:
            return False
    except OSError:
        pass
    write_atomically(path, text, mode=0o644)  # Prometheus, another user, reads it
    return True
