"""SlurmClient: what ft asks of Slurm, behind one small interface with two backends.

- CliSlurmClient: Slurm's command-line tools, `--json` where this Slurm has it, text otherwise;
  every call with a timeout. Works wherever the tools do.
- PyslurmClient: pyslurm, used only when it is installed and built for this cluster's Slurm
  (pyslurm builds against exactly one Slurm release); otherwise `pyslurm_unavailable_reason()` says why.

Job state comes from squeue while Slurm remembers the job, then sacct (accounting), then the
job-completion log, so it stays right after squeue forgets a job and on sites without accounting.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from toolkit.slurm import commands, job_comment, jobs, shapes
from toolkit.slurm import nodes as slurm_nodes
from toolkit.slurm.commands import SlurmCommandError, SlurmUnavailable

FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED"}


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    state: str
    source: str  # squeue | sacct | jobcomp
    nodes: str = ""
    reason: str = ""
    exit_code: int | None = None
    restarts: int = 0
    elapsed_s: int | None = None

    @property
    def finished(self) -> bool:
        return self.state in FINISHED

    def describe(self) -> str:
        return self.state + (f" ({self.reason})" if self.reason and self.reason != "None" else "")


def job_nodes(client: SlurmClient, job_id: str) -> list[str] | None:
    """The nodes a running job holds now, as Slurm has them (a --no-kill job's lost nodes are taken
    out of it); None where Slurm does not say."""
    info = client.job_brief(job_id)
    return client.hostnames(info.nodes) if info and info.nodes else None


def wait_for_job(client: SlurmClient, job_id: str, on_state: Callable[[JobInfo], None],
                 timeout_s: float | None = None, poll_s: float = 2.0) -> JobInfo | None:
    """Poll a job until it has finished (a requeue is not an end) or `timeout_s` passed; returns
    what was last seen of it (None: never seen)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    info = None
    while deadline is None or time.monotonic() < deadline:
        info = client.job(job_id) or info
        if info is not None:
            on_state(info)
            if info.finished:
                return info
        time.sleep(poll_s)
    return info


class SlurmClient(Protocol):
    name: str

    def version(self) -> tuple[int, int, int]: ...

    def job(self, job_id: str) -> JobInfo | None: ...

    def queued_runs(self) -> dict[str, str]: ...

    def nodes(self) -> list[slurm_nodes.NodeDetail]: ...

    def cancel(self, job_ids: list[str]) -> None: ...

    def hostnames(self, nodelist: str) -> list[str]: ...

    def mark_node_down(self, node: str, reason: str) -> bool: ...

    def drain_node(self, node: str, reason: str) -> bool: ...

    def requeue(self, job_id: str) -> bool: ...

    def start_after(self, job_id: str, seconds: int) -> bool: ...

    def job_brief(self, job_id: str) -> JobInfo | None: ...

    def job_pids_here(self, job_id: str) -> list[int] | None: ...

    def drained(self, nodes: list[str]) -> dict[str, str]: ...

    def unresponsive(self, nodes: list[str]) -> list[str]: ...

    def config_seconds(self, name: str) -> int | None: ...

    def config_number(self, name: str) -> int | None: ...

    def slurmd_answers(self, address: str, port: int) -> bool: ...

    def node_addresses(self, nodes: list[str]) -> dict[str, str]: ...

    def requeues_preempted(self, job_id: str, partition: str) -> bool: ...

    def job_steps(self, job_id: str) -> dict[str, list[str]] | None: ...

    def signal_step(self, step_id: str, signal_name: str) -> bool: ...

    def end_time(self, job_id: str) -> float | None: ...

    def complete_job(self, job_id: str, exit_code: int) -> bool: ...


def _parse_version(text: str) -> tuple[int, int, int]:
    match = re.search(r"(\d+)\.(\d+)\.(\d+)", text)
    if not match:
        raise SlurmCommandError(f"cannot read the Slurm version from {text!r}")
    return int(match[1]), int(match[2]), int(match[3])


def _state(value) -> str:
    return shapes.state(value) or "UNKNOWN"


class CliSlurmClient:
    name = "cli"

    def __init__(self, timeout: float = commands.DEFAULT_TIMEOUT_S):
        self.timeout = timeout

    @functools.cache  # noqa: B019 - one client per process; the version does not change under it
    def version(self) -> tuple[int, int, int]:
        return _parse_version(commands.run(["sbatch", "--version"], timeout=self.timeout).stdout)

    def supports_json(self) -> bool:
        return self.version() >= (21, 8, 0)

    def job(self, job_id: str) -> JobInfo | None:
        return self._from_squeue(job_id) or self._from_sacct(job_id) or self._from_jobcomp(job_id)

    def nodes(self) -> list[slurm_nodes.NodeDetail]:
        """Every node: its state and flags, reason and GPUs (`sinfo --Node --json`, any version's shape)."""
        return slurm_nodes.node_details(commands.run, timeout=self.timeout)

    def queued_runs(self) -> dict[str, str]:
        """Run id -> the newest of this user's queued jobs for it, by the `ft-run=<id>` part of the
        comment ft's job script carries: how a run whose job has not started yet is found. One
        squeue call, whatever the number of runs."""
        runs: dict[str, str] = {}
        for job_id, comment in jobs.own_jobs(commands.run, timeout=self.timeout) or []:
            run_id = job_comment.run_of(comment)
            if run_id is not None and (run_id not in runs or int(job_id) > int(runs[run_id])):
                runs[run_id] = job_id
        return runs

    def cancel(self, job_ids: list[str]) -> None:
        jobs.cancel(job_ids, lambda argv, **options: commands.run(argv, **options, timeout=self.timeout))

    def hostnames(self, nodelist: str) -> list[str]:
        """node[1-3,5] -> node1 node2 node3 node5, in the allocation's order."""
        return commands.run(["scontrol", "show", "hostnames", nodelist], timeout=self.timeout).stdout.split()

    def mark_node_down(self, node: str, reason: str) -> bool:
        """Mark a node DOWN with a reason; False where this user lacks Slurm operator rights."""
        result = commands.run(["scontrol", "update", f"NodeName={node}", "State=DOWN", f"Reason={reason}"],
                              timeout=self.timeout, check=False)
        return result.returncode == 0

    def drain_node(self, node: str, reason: str) -> bool:
        """Drain a node with a reason: no new job lands on it, an admin looks; False where this user
        lacks Slurm operator rights."""
        result = commands.run(["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}"],
                              timeout=self.timeout, check=False)
        return result.returncode == 0

    def requeue(self, job_id: str) -> bool:
        return commands.run(["scontrol", "requeue", job_id], timeout=self.timeout, check=False).returncode == 0

    def start_after(self, job_id: str, seconds: int) -> bool:
        """Let a pending job start `seconds` from now at the earliest (its begin time): what lifts
        the hold Slurm puts on a requeued job (toolkit/watch/requeue.py)."""
        result = commands.run(["scontrol", "update", f"JobId={job_id}", f"StartTime=now+{max(0, int(seconds))}"],
                              timeout=self.timeout, check=False)
        return result.returncode == 0

    def job_pids_here(self, job_id: str) -> list[int] | None:
        """The processes of a job on this node (`scontrol listpids`: this node's slurmd, whatever
        tracks them, cgroups or process groups); None where it cannot tell."""
        result = commands.run(["scontrol", "listpids", job_id], timeout=self.timeout, check=False)
        if result.returncode != 0:
            return None
        return [int(fields[0]) for fields in map(str.split, result.stdout.splitlines()[1:])
                if fields and fields[0].isdigit()]

    def job_brief(self, job_id: str) -> JobInfo | None:
        """One job's state, restart count and nodes from the controller (`scontrol show job`: one job,
        where 22.05's `squeue --json` dumps the whole queue whatever it is asked); None once it is
        forgotten. A completing job's nodes are those still completing (Slurm names only those)."""
        result = commands.run(["scontrol", "show", "job", "-o", job_id], timeout=self.timeout, check=False)
        fields = dict(re.findall(r"(?:^|\s)(JobId|JobState|Restarts|NodeList)=(\S+)", result.stdout))
        if result.returncode != 0 or fields.get("JobId") != job_id or "JobState" not in fields:
            return None
        restarts = fields.get("Restarts", "0")
        nodes = fields.get("NodeList", "")
        return JobInfo(job_id, _state(fields["JobState"]), "scontrol", nodes="" if nodes == "(null)" else nodes,
                       restarts=int(restarts) if restarts.isdigit() else 0)

    def drained(self, nodes: list[str]) -> dict[str, str]:
        """The nodes among these that are drained or draining (a health check found them bad, or an
        admin took them out), with the reason."""
        return slurm_nodes.drained(nodes, commands.run, timeout=self.timeout)

    def unresponsive(self, nodes: list[str]) -> list[str]:
        """The nodes among these whose slurmd does not answer the controller (or that are down)."""
        return slurm_nodes.unresponsive(nodes, commands.run, timeout=self.timeout)

    def config_seconds(self, name: str) -> int | None:
        """A duration of Slurm's configuration, in seconds (SlurmdTimeout: how long the controller
        waits for a silent slurmd before marking its node DOWN; KillWait: from a job's TERM to its
        KILL); None where `scontrol show config` does not say."""
        return self.config_number(name)

    def node_addresses(self, nodes: list[str]) -> dict[str, str]:
        """Each node's NodeAddr, where Slurm says it (sinfo)."""
        return slurm_nodes.node_addresses(nodes, commands.run, timeout=self.timeout)

    def slurmd_answers(self, address: str, port: int) -> bool:
        """Whether the slurmd at this address takes a connection on `port` (the cluster's SlurmdPort)."""
        return slurm_nodes.slurmd_answers(address, port)

    def config_number(self, name: str) -> int | None:
        """A number of Slurm's configuration (SlurmdPort; durations in seconds, "30 sec" read as
        30); None where `scontrol show config` does not say."""
        try:
            value = slurm_nodes.config(commands.run, timeout=self.timeout).get(name, "")
        except SlurmCommandError:
            return None
        match = re.fullmatch(r"(\d+)\s*(?:sec)?", value)
        return int(match[1]) if match else None

    def requeues_preempted(self, job_id: str, partition: str) -> bool:
        """Whether Slurm requeues this job itself as it ends: preempted (its PreemptTime set) in a
        partition whose PreemptMode requeues, on Slurm 24.05 or newer ("assume that a job signalled
        for GraceTime was preempted"); before 24.05 such a job just completes."""
        try:
            if self.version() < (24, 5, 0):
                return False
            job = commands.run(["scontrol", "show", "job", "--oneliner", job_id], timeout=self.timeout)
            preempted = slurm_nodes.key_values(job.stdout).get("PreemptTime", "None")
            modes = slurm_nodes.partitions(commands.run)
        except SlurmCommandError:
            return False
        mode = modes[partition].preempt_mode if partition in modes else "OFF"
        return preempted[:1].isdigit() and "REQUEUE" in mode.upper().split(",")

    def job_steps(self, job_id: str) -> dict[str, list[str]] | None:
        """The job's running steps ("J.S": their nodes), its batch and extern steps left out; None
        where Slurm did not answer (no answer is not "no steps")."""
        result = commands.run(["squeue", "--steps", "--noheader", "--jobs", job_id, "--format=%i|%N"],
                              timeout=self.timeout, check=False)
        if result.returncode != 0:
            return None
        steps = {}
        for line in result.stdout.splitlines():
            step, _, nodes = line.strip().partition("|")
            if step.startswith(f"{job_id}.") and step.split(".", 1)[1].isdigit():
                steps[step] = self.hostnames(nodes) if nodes else []
        return steps

    def signal_step(self, step_id: str, signal_name: str) -> bool:
        """A signal to every task of a step (`scancel --signal`), as srun passes one on to its
        tasks; "TERM" without --signal: the step cancelled (TERM, then KILL after KillWait)."""
        argv = ["scancel", step_id] if signal_name == "TERM" else ["scancel", f"--signal={signal_name}", step_id]
        return commands.run(argv, timeout=self.timeout, check=False).returncode == 0

    def end_time(self, job_id: str) -> float | None:
        """When the job's time limit ends it (epoch seconds, the controller's clock); None where
        it has none or Slurm does not say. Asked afresh: an admin may extend a job's limit."""
        result = commands.run(["scontrol", "show", "job", "-o", job_id], timeout=self.timeout, check=False)
        end = slurm_nodes.key_values(result.stdout).get("EndTime", "")
        try:
            return time.mktime(time.strptime(end, "%Y-%m-%dT%H:%M:%S"))
        except ValueError:
            return None

    def complete_job(self, job_id: str, exit_code: int) -> bool:
        """End this user's running job with an exit code, as its batch script's end would
        (toolkit/slurm/libslurm.py: no command does it)."""
        from toolkit.slurm import libslurm

        return libslurm.complete_job(job_id, exit_code)

    # -- sources -----------------------------------------------------------------------------
    def _from_squeue(self, job_id: str) -> JobInfo | None:
        if self.supports_json():
            result = commands.run(["squeue", "--json", "--jobs", job_id], timeout=self.timeout, check=False)
            if result.returncode != 0:
                return None  # squeue exits non-zero for a job it no longer knows
            try:
                listed = jobs.parse_queue(result.stdout)
            except ValueError:
                return None
            for job in listed:  # 22.05 lists the whole queue whatever it is asked
                if job.job_id == job_id:
                    return JobInfo(job_id, job.state or "UNKNOWN", "squeue", job.nodes, job.reason, None,
                                   job.restarts)
            return None
        result = commands.run(["squeue", "--noheader", "--jobs", job_id, "--format=%T|%N|%r"],
                              timeout=self.timeout, check=False)
        line = result.stdout.strip()
        if result.returncode != 0 or not line:
            return None
        state, nodes, reason = (line.split("|") + ["", ""])[:3]
        return JobInfo(job_id, _state(state), "squeue", nodes, reason)

    def _from_sacct(self, job_id: str) -> JobInfo | None:
        result = commands.run(["sacct", "--noheader", "--parsable2", "--allocations", "--jobs", job_id,
                               "--format=JobIDRaw,State,NodeList,ExitCode,ElapsedRaw"],
                              timeout=self.timeout, check=False)
        if result.returncode != 0:
            return None  # accounting disabled or unreachable: fall through to the completion log
        rows = [line.split("|") for line in result.stdout.splitlines() if line.split("|")[0] == job_id]
        if not rows:
            return None
        _, state, nodes, exit_code, elapsed = rows[-1][:5]
        return JobInfo(job_id, _state(state), "sacct", nodes, "", int(exit_code.split(":")[0] or 0),
                       len(rows) - 1, int(elapsed or 0))

    @functools.cache  # noqa: B019 - the completion log does not move while ft runs
    def _jobcomp_path(self) -> str | None:
        result = commands.run(["scontrol", "show", "config"], timeout=self.timeout, check=False)
        config = commands.parse_config(result.stdout)
        location = config.get("JobCompLoc", "")
        return location if "filetxt" in config.get("JobCompType", "") and location else None

    def _from_jobcomp(self, job_id: str) -> JobInfo | None:
        path = self._jobcomp_path()
        if not path:
            return None
        found = None
        try:
            with open(path, errors="replace") as handle:
                for line in handle:
                    if line.startswith(f"JobId={job_id} "):
                        found = dict(re.findall(r"(\w+)=(\S*)", line))
        except OSError:
            return None
        if not found:
            return None
        exit_code = found.get("ExitCode", "0:0").split(":")[0]
        return JobInfo(job_id, _state(found.get("JobState", "")), "jobcomp", found.get("NodeList", ""), "",
                       int(exit_code) if exit_code.isdigit() else None)


class PyslurmClient(CliSlurmClient):
    """pyslurm for job queries when it matches this Slurm; the CLI otherwise stays authoritative."""

    name = "pyslurm"

    def __init__(self, timeout: float = commands.DEFAULT_TIMEOUT_S):
        super().__init__(timeout)
        import pyslurm

        self._pyslurm = pyslurm

    def job(self, job_id: str) -> JobInfo | None:
        try:
            job = self._pyslurm.Job.load(int(job_id))
        except self._pyslurm.RPCError:  # an unknown job (or one pyslurm cannot read): the CLI answers
            return super().job(job_id)
        return JobInfo(job_id, _state(job.state), "pyslurm", str(job.allocated_nodes or ""), str(job.state_reason))


def pyslurm_unavailable_reason(slurm_version: tuple[int, int, int] | None) -> str | None:
    """Why the pyslurm backend is not used here, or None when it can be."""
    try:
        import pyslurm
    except ImportError:
        return "pyslurm is not installed (it builds only against one Slurm release: pip install pyslurm==<X.Y>)"
    built = _parse_version(getattr(pyslurm, "__version__", "0.0.0"))
    if slurm_version is None or built[:2] != slurm_version[:2]:
        found = ".".join(map(str, slurm_version)) if slurm_version else "unknown"
        return (f"pyslurm {'.'.join(map(str, built))} is built for Slurm {built[0]}.{built[1]}; "
                f"this cluster runs {found}")
    return None


def default_client() -> SlurmClient:
    cli = CliSlurmClient()
    try:
        version = cli.version()
    except (SlurmUnavailable, SlurmCommandError):  # no Slurm to ask: the CLI reports it later
        return cli
    return PyslurmClient() if pyslurm_unavailable_reason(version) is None else cli
