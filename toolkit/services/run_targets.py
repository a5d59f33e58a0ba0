"""Which runs Prometheus scrapes, and under whose name: the runs' claims, checked against Slurm.

A run's watchdog says where it serves its metrics with a claim, <claims>/<run>.<job id>.json
(toolkit/watch/metrics.RunExporter), in a folder every user of the cluster writes (like runs/).
Whatever such a file says, anyone could have written it, so Prometheus never reads it. The cluster
exporter (toolkit/services/cluster_metrics.py, as its own unprivileged user) publishes a claim only when

  - Slurm runs the job the file names, a job of ft's whose run the file names too (its comment:
    ft-run=<run>; `squeue --json`, where a comment cannot forge a line; any Slurm version's shape:
    toolkit/slurm/jobs.py),
  - the file's owner is the job's user (a file is owned by whoever made it; nobody can give theirs away),
  - the address is the job's batch host (where its watchdog runs) and a port,

  - the job's batch script, as Slurm holds it (`scontrol write batch_script`: the exporter's account
    is a Slurm operator), is ft's for that run: its header names the run, and it ends by handing
    over to ft's job controller (`exec ... -m toolkit.job`). A plain `sleep` job whose comment and
    claim name a run is not published. (A user can still write such a script by hand: the shape is
    checked, not who rendered it; what follows keeps that to their own job's nodes and names.)

and labels it with Slurm's word: run (the job's comment), user, slurm_job. Prometheus reads only the
published file, in a folder only the exporter writes. A run's own metrics carry none of these labels:
a user's process may serve anything, but only ever under its own user, job and run.

Each job is published as one target per scope: the run's own series (`scope: job`: Prometheus
drops any series there that names a node) and one per node Slurm gave the job (`scope: node`,
`node: <Slurm's name>`, asking the exporter for that node's series alone: `?scope=node&node=N`). A
node's series are labelled with Slurm's node, whatever the process served: a run serves series for
its own nodes only, and a GPU alert can fire only for a node the run holds.

A claim whose job has ended is not published (a watchdog lost with its batch host leaves its file).
The run's name is the job's own word (its comment): alerts and dashboards know a run by its run
and user together, and the user is Slurm's.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from toolkit.base.shared_dirs import login_name, write_atomically
from toolkit.slurm import commands, job_comment, jobs

CLAIM_MAX_BYTES = 4096  # a claim is one address; anything larger is not one of ours
PUBLISHED_NAME = "runs.json"
# <run>.<job id>.json; <run>.<job id>-<8 hex>.json where another user took the plain name first.
CLAIM_NAME = re.compile(r"(?P<run>[A-Za-z0-9][A-Za-z0-9._-]{0,127})\.(?P<job>[0-9]{1,12})(?:-[0-9a-f]{8})?\.json")
ADDRESS = re.compile(r'\[\{"targets": ?\["(?P<host>[A-Za-z0-9._-]{1,253}):(?P<port>[0-9]{1,5})"\]\}\]\s*')
WHY_MAX = 200  # a refusal's reason, as logged
MAX_CLAIMS_READ = 16  # per running job, newest first: its watchdog writes one (two where a name was taken)
MAX_REFUSALS = 100  # named one by one in a turn; the rest counted


@dataclass(frozen=True)
class RunningJob:
    job_id: str
    user: str
    batch_host: str
    run: str  # from the job's comment: ft-run=<run>
    nodes: tuple[str, ...] = ()  # Slurm's, expanded


SCRIPT_HEADER = "# ft job script: run {run} of recipe "
SCRIPT_HANDOVER = re.compile(r"exec .+ -m toolkit\.job")  # the interpreter as the template quotes it


def script_problem(script: str, run: str) -> str | None:
    """Why a job's batch script is not ft's for `run` (None: it is): ft's header naming the run as its
    second line, and its last command the hand-over to ft's job controller."""
    lines = script.splitlines()
    if len(lines) < 2 or lines[0] != "#!/bin/bash" or not lines[1].startswith(SCRIPT_HEADER.format(run=run)):
        return f"its batch script is not ft's job script of run {run}"
    commands_left = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not commands_left or not SCRIPT_HANDOVER.fullmatch(commands_left[-1]):
        return "its batch script does not end by handing over to ft's job controller"
    return None


@dataclass(frozen=True)
class Refusal:
    claim: str
    why: str


def running_ft_jobs(run: Callable = commands.run, timeout: float = 10.0) -> dict[str, RunningJob]:
    """ft's running jobs, as Slurm says (squeue --json): FtError where Slurm does not answer."""
    try:
        listed = jobs.queue(run, timeout=timeout)
    except ValueError:
        return {}
    return ft_running(listed)


def ft_running(listed: list[jobs.QueuedJob]) -> dict[str, RunningJob]:
    """ft's running jobs among Slurm's, whatever its version. A job id listed twice is no one's
    (Slurm lists a job once: anything else is not to be trusted)."""
    found: dict[str, RunningJob] = {}
    doubled: set[str] = set()
    for job in listed:
        run = job_comment.run_of(job.comment)
        if job.state != "RUNNING" or not job.job_id.isdigit() or run is None or not job.user or not job.batch_host:
            continue
        if job.job_id in found:
            doubled.add(job.job_id)
        found[job.job_id] = RunningJob(job.job_id, job.user, job.batch_host, run,
                                       tuple(commands.expand_hostlist(job.nodes)) if job.nodes else ())
    return {job_id: job for job_id, job in found.items() if job_id not in doubled}


def read_claim(path: Path, job: RunningJob) -> tuple[str, float]:
    """The claim's address (host:port) and its time, or ValueError saying why it is not published."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a link or a FIFO: refused
    with os.fdopen(descriptor, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a plain file")
        owner = login_name(info.st_uid) or f"uid {info.st_uid}"
        if owner != job.user:
            raise ValueError(f"owned by {owner}, while job {job.job_id} is {job.user}'s")
        content = handle.read(CLAIM_MAX_BYTES + 1)
    if len(content) > CLAIM_MAX_BYTES:
        raise ValueError(f"larger than {CLAIM_MAX_BYTES} bytes")
    # Matched, not parsed: a claim is one address in the one shape ft writes (no parser to exhaust).
    address = ADDRESS.fullmatch(content.decode("ascii", errors="replace"))
    if address is None:
        raise ValueError('not [{"targets": ["host:port"]}], the one shape a claim has')
    host, port = address.group("host"), int(address.group("port"))
    if host != job.batch_host:
        raise ValueError(f"names host {host!r}; job {job.job_id} runs its watchdog on {job.batch_host}")
    if not 0 < port < 65536:
        raise ValueError(f"names port {port}")
    return f"{host}:{port}", info.st_mtime


def verified_targets(claims: Path, jobs: dict[str, RunningJob],
                     script: Callable[[RunningJob], str | None] = lambda job: None) -> tuple[list[dict], list[Refusal]]:
    """file_sd groups for the claims Slurm vouches for (one per job: its user's newest; a group per
    scope, see above), and why each other claim of a running job is not published (a claim of a job
    that is not running is ignored: it is the normal end of a lost run). `script(job)` says why the
    job's batch script is not ft's (None: it is), asked only for a job with a claim to publish. The
    cost is bounded whatever the folder holds: a name and an lstat per file, and at most
    MAX_CLAIMS_READ files opened per running job (a watchdog writes one)."""
    refusals: list[Refusal] = []
    owners: dict[int, str] = {}
    candidates: dict[str, list[tuple[float, str]]] = {}
    try:
        listing = os.scandir(claims)
    except OSError:
        return [], []
    with listing:
        for entry in listing:
            named = CLAIM_NAME.fullmatch(entry.name)
            job = jobs.get(named.group("job")) if named else None
            if job is None:
                continue
            try:
                if named.group("run") != job.run:
                    raise ValueError(f"names run {named.group('run')}; job {job.job_id} runs {job.run}")
                info = entry.stat(follow_symlinks=False)
                if info.st_uid not in owners:
                    owners[info.st_uid] = login_name(info.st_uid) or f"uid {info.st_uid}"
                if owners[info.st_uid] != job.user:  # refused before it is opened
                    raise ValueError(f"owned by {owners[info.st_uid]}, while job {job.job_id} is {job.user}'s")
            except Exception as error:  # noqa: BLE001 - whatever a claim does, it costs only itself
                refusals.append(Refusal(entry.name, (str(error) or type(error).__name__)[:WHY_MAX]))
                continue
            candidates.setdefault(job.job_id, []).append((info.st_mtime, entry.name))
    newest: dict[str, tuple[float, str, str]] = {}
    for job_id, found in candidates.items():
        found.sort(reverse=True)
        for _, name in found[:MAX_CLAIMS_READ]:
            try:
                address, made = read_claim(claims / name, jobs[job_id])
            except Exception as error:  # noqa: BLE001 - as above: a claim's trouble costs only itself
                refusals.append(Refusal(name, (str(error) or type(error).__name__)[:WHY_MAX]))
                continue
            if made >= newest.get(job_id, (float("-inf"), "", ""))[0]:
                newest[job_id] = (made, address, name)
        if len(found) > MAX_CLAIMS_READ:
            refusals.append(Refusal(f"{len(found) - MAX_CLAIMS_READ} older claims of job {job_id}",
                                    f"not read: a job's newest {MAX_CLAIMS_READ} are"))
    groups = []
    for job_id, (_, address, name) in sorted(newest.items()):
        job = jobs[job_id]
        try:
            why = script(job)
        except Exception as error:  # noqa: BLE001 - Slurm refusing the script: this job is not published
            why = f"its batch script could not be read ({str(error) or type(error).__name__})"
        if why:
            refusals.append(Refusal(name, why[:WHY_MAX]))
            continue
        groups += scoped_groups(address, job)
    return groups, refusals[:MAX_REFUSALS] + ([Refusal(f"{len(refusals) - MAX_REFUSALS} more claims", "refused")]
                                              if len(refusals) > MAX_REFUSALS else [])


def scoped_groups(address: str, job: RunningJob) -> list[dict]:
    """The job's targets: its run's own series, then each of its nodes' (Slurm's names)."""
    who = {"run": job.run, "user": job.user, "slurm_job": job.job_id}
    return [{"targets": [address], "labels": who | {"scope": "job", "__param_scope": "job"}},
            *({"targets": [address], "labels": who | {"scope": "node", "node": node, "__param_scope": "node",
                                                       "__param_node": node}} for node in job.nodes)]


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
