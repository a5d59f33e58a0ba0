"""The training environment of a user who does not run the cluster (`ft cluster prepare`).

A venv on the shared filesystem, built by a short Slurm job on a compute node (so it matches the
compute nodes' architecture, system libraries and drivers), from wheels the login node gathers
first: compute nodes often have no internet, login nodes do. Or a container image with ft[train],
for pyxis/enroot sites, which is recorded, not built. The profile records which, and every
rendered script runs the right interpreter for it (`ClusterProfile.training_python`).

    <shared root>/envs/uid-N/wheelhouse/         wheels + constraints.txt (reused between builds)
    <shared root>/envs/uid-N/ft-<build>/          the venv; .ft-build marks it complete
    <shared root>/envs/uid-N/prepare-<build>.sbatch, prepare-<build>.log
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from toolkit import __version__
from toolkit.build import build_id
from toolkit.cluster.profile import ClusterProfile, ProfileError
from toolkit.errors import FtError
from toolkit.paths import resource_dir
from toolkit.shared_dirs import common_dir, private_dir, require_trusted, shared_root_path, write_atomically
from toolkit.slurm import commands

READY_STAMP = ".ft-build"


class PrepareError(FtError):
    pass


@dataclass(frozen=True)
class EnvPlace:
    folder: Path  # <shared root>/envs/uid-N

    @property
    def wheelhouse(self) -> Path:
        return self.folder / "wheelhouse"

    def venv(self, build: str) -> Path:
        return self.folder / f"ft-{build}"

    def script(self, build: str) -> Path:
        return self.folder / f"prepare-{build}.sbatch"

    def log(self, build: str) -> Path:
        return self.folder / f"prepare-{build}.log"


def env_place(profile: ClusterProfile) -> EnvPlace:
    """This user's folder for environments on the profile's shared root (private; refused when
    another user made it first: a venv is code every job runs)."""
    if not profile.shared_root:
        raise ProfileError(f"cluster profile {profile.name} has no shared_root: the compute nodes need the "
                           "environment on a filesystem they share",
                           hint=f"`ft cluster set {profile.name} shared_root=/path/on/the/shared/filesystem`")
    root = shared_root_path(profile.shared_root)
    if not root.is_dir():
        raise ProfileError(f"the shared root {root} does not exist",
                           hint=f"`mkdir -p {root}` if it is yours to make, or `ft cluster set {profile.name} "
                                "shared_root=...` (a folder on the shared filesystem you may write)")
    return EnvPlace(private_dir(common_dir(require_trusted(root) / "envs") / f"uid-{os.getuid()}"))


def ready_build(python: str) -> str | None:
    """The ft build a prepared venv holds (its stamp), or None: not built, or its build failed."""
    stamp = Path(python).parent.parent / READY_STAMP
    try:
        return stamp.read_text().strip() or None
    except OSError:
        return None


def source_tree() -> Path | None:
    """The checkout this ft runs from, when it runs from one (its pyproject.toml names ft)."""
    root = Path(__file__).resolve().parents[2]
    project = root / "pyproject.toml"
    if project.is_file() and 'name = "ft"' in project.read_text():
        return root
    return None


def constraints_file() -> Path:
    """The pins the training stack was tested with (torch first of all)."""
    for candidate in (Path(__file__).resolve().parents[2] / "constraints.txt",
                      resource_dir("sbatch_templates").parent / "constraints.txt"):
        if candidate.is_file():
            return candidate
    raise PrepareError("ft's constraints.txt is missing from this installation",
                       hint="reinstall ft (scripts/install-user.sh) from its checkout")


def gather_wheels(place: EnvPlace, log: Path, run: Callable = subprocess.run) -> Path:
    """ft's own wheel and every wheel ft[train] needs, pinned, into the wheelhouse. Returns ft's wheel."""
    place.wheelhouse.mkdir(mode=0o700, exist_ok=True)
    for old in place.wheelhouse.glob("ft-*.whl"):
        old.unlink()  # the wheel of another build of the same version would be taken for this one
    shutil.copyfile(constraints_file(), place.wheelhouse / "constraints.txt")
    source = source_tree()
    requirement = f"{source}[train]" if source else f"ft[train]=={__version__}"
    # pip's own settings (PIP_INDEX_URL, PIP_FIND_LINKS: a site's mirror) apply: none given here.
    argv = [sys.executable, "-m", "pip", "wheel", "--disable-pip-version-check", "--wheel-dir",
            str(place.wheelhouse), "--constraint", str(place.wheelhouse / "constraints.txt"), requirement]
    with open(log, "w") as output:
        completed = run(argv, stdout=output, stderr=subprocess.STDOUT, env={**os.environ, "DS_BUILD_OPS": "0"},
                        stdin=subprocess.DEVNULL, check=False)
    if completed.returncode != 0:
        raise PrepareError(f"gathering the training stack's wheels failed (pip, exit {completed.returncode}): "
                           f"{tail(log)}", hint=f"the whole log: {log}; the login node needs the package index")
    wheels = sorted(place.wheelhouse.glob(f"ft-{__version__}-*.whl"))
    if not wheels:
        raise PrepareError(f"pip built no wheel of ft {__version__} into {place.wheelhouse}", hint=f"see {log}")
    return wheels[-1]


def tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def render_job(profile: ClusterProfile, place: EnvPlace, build: str, wheel: Path, base_python: str,
               offline: bool, time_minutes: int = 30) -> str:
    from toolkit.render.sbatch import template_environment

    standard = profile.tiers.get("standard") or next(iter(profile.tiers.values()))
    return template_environment().get_template("prepare_env.sbatch.j2").render(
        version=__version__, profile=profile, partition=standard.partition, qos=standard.qos,
        account=profile.default_account, time_minutes=f"{time_minutes:02d}", log=str(place.log(build)),
        target=str(place.venv(build)), wheelhouse=str(place.wheelhouse), base_python=base_python,
        offline=offline, requirement=f"{wheel}[train]", python_version=sys.version_info[:2],
        python_tag=f"cp{sys.version_info.major}{sys.version_info.minor}")


def submit_and_wait(script: Path, on_state: Callable[[str], None], timeout_s: float) -> tuple[str, str]:
    """sbatch the script; wait for its end. Returns (job id, final state)."""
    from toolkit.slurm.client import CliSlurmClient

    submitted = commands.run(["sbatch", "--parsable", str(script)])
    job_id = submitted.stdout.strip().split(";")[0]
    client = CliSlurmClient()
    deadline = time.monotonic() + timeout_s
    state = "PENDING"
    while time.monotonic() < deadline:
        info = client.job(job_id)
        state = info.state if info else state
        on_state(f"job {job_id}: {state}" + (f" ({info.reason})" if info and info.reason else ""))
        if info and info.finished:
            return job_id, state
        time.sleep(2)
    commands.run(["scancel", job_id], check=False)
    return job_id, "TIMEOUT (ft's wait; job cancelled)"


def prepare_venv(profile: ClusterProfile, base_python: str = "python3", offline: bool = True,
                 on_state: Callable[[str], None] = lambda _: None, timeout_s: float = 3600) -> Path:
    """Build the venv on a compute node; returns its interpreter. Nothing is recorded on failure."""
    place = env_place(profile)
    build = build_id()
    venv = place.venv(build)
    if ready_build(str(venv / "bin" / "python")) == build:
        return venv / "bin" / "python"
    on_state("gathering wheels on the login node (pip)")
    wheel = gather_wheels(place, place.folder / f"wheels-{build}.log")
    script = place.script(build)
    write_atomically(script, render_job(profile, place, build, wheel, base_python, offline), mode=0o700)
    job_id, state = submit_and_wait(script, on_state, timeout_s)
    built = ready_build(str(venv / "bin" / "python"))
    if state != "COMPLETED" or built != build:
        raise PrepareError(f"the environment job {job_id} ended {state} without a complete environment:\n"
                           f"{tail(place.log(build))}",
                           hint=f"the job's log: {place.log(build)}; its script: {script}")
    return venv / "bin" / "python"


def prune(place: EnvPlace, keep: set[Path]) -> list[Path]:
    """Remove this user's older environments (a venv is about 2 GB), keeping `keep`."""
    removed = []
    for venv in place.folder.glob("ft-*"):
        if venv.is_dir() and venv not in keep:
            shutil.rmtree(venv, ignore_errors=True)
            removed.append(venv)
    return removed
