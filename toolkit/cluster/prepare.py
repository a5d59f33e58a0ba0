"""The training environment of a user who does not run the cluster (`ft cluster prepare`).

A venv on the shared filesystem, built by a short Slurm job on a compute node (so it matches the
compute nodes' architecture, system libraries and drivers), from wheels the login node gathers
first: compute nodes often have no internet, login nodes do. Or a container image with ft[train],
for pyxis/enroot sites, which is recorded, not built. The profile records which, and every
rendered script runs the right interpreter for it (`ClusterProfile.training_python`).

    <shared root>/envs/uid-N/wheelhouse/                  wheels + constraints.txt
    <shared root>/envs/uid-N/<profile>/ft-<build>/         the venv; .ft-build marks it complete
    <shared root>/envs/uid-N/<profile>/prepare-<build>.sbatch, .log, wheels-<build>.log

The wheels are the login node's platform's: where compute nodes differ (an aarch64 partition
behind an x86_64 login node), the job says so and `--online` lets it install from the index.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from toolkit.base.build import VERSION, build_id
from toolkit.base.errors import FtError
from toolkit.base.paths import resource_dir
from toolkit.base.shared_dirs import (
    SharedFolderError,
    private_dir,
    require_trusted,
    shared_root_path,
    user_folder,
    write_atomically,
)
from toolkit.cluster.profile import ClusterProfile, ProfileError
from toolkit.slurm import commands
from toolkit.slurm import jobs as slurm_jobs

READY_STAMP = ".ft-build"


class PrepareError(FtError):
    pass


@dataclass(frozen=True)
class EnvPlace:
    user_folder: Path  # <shared root>/envs/uid-N
    profile: str

    @property
    def wheelhouse(self) -> Path:
        return self.user_folder / "wheelhouse"

    @property
    def folder(self) -> Path:
        return self.user_folder / self.profile

    def venv(self, build: str) -> Path:
        return self.folder / f"ft-{build}"

    def script(self, build: str) -> Path:
        return self.folder / f"prepare-{build}.sbatch"

    def log(self, build: str) -> Path:
        return self.folder / f"prepare-{build}.log"

    def wheels_log(self, build: str) -> Path:
        return self.folder / f"wheels-{build}.log"


def env_place(profile: ClusterProfile) -> EnvPlace:
    """This user's folder for this profile's environments on its shared root (private; refused when
    another user made it first: a venv is code every job runs)."""
    fix = f"ft cluster set {profile.name} shared_root=/a/folder/on/the/shared/filesystem/you/may/write"
    if not profile.shared_root:
        raise ProfileError(f"cluster profile {profile.name} has no shared_root: the compute nodes need the "
                           "environment on a filesystem they share", hint=fix)
    root = shared_root_path(profile.shared_root)
    if not root.is_dir():
        raise ProfileError(f"the shared root {root} does not exist", hint=f"mkdir -p {root}, or {fix}")
    try:
        mine = user_folder(require_trusted(root), "envs")
        private_dir(mine / profile.name)
    except SharedFolderError as exc:
        raise ProfileError(exc.message, hint=f"{exc.hint}; or {fix}") from None
    return EnvPlace(mine, profile.name)


def ready_build(python: str | Path) -> str | None:
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
    requirement = f"{source}[train]" if source else f"ft[train]=={VERSION}"
    # pip's own settings (PIP_INDEX_URL, PIP_FIND_LINKS: a site's mirror) apply: none given here.
    # --use-pep517: an older pip (Debian's venvs have 23.0, without `wheel`) builds deepspeed's
    # source package the way current ones do, instead of failing on bdist_wheel.
    argv = [sys.executable, "-m", "pip", "wheel", "--disable-pip-version-check", "--use-pep517", "--wheel-dir",
            str(place.wheelhouse), "--constraint", str(place.wheelhouse / "constraints.txt"), requirement]
    with open(log, "w") as output:
        completed = run(argv, stdout=output, stderr=subprocess.STDOUT, env={**os.environ, "DS_BUILD_OPS": "0"},
                        stdin=subprocess.DEVNULL, check=False)
    if completed.returncode != 0:
        raise PrepareError(f"gathering the training stack's wheels failed (pip, exit {completed.returncode}): "
                           f"{tail(log)}", hint=f"the whole log: {log}")
    wheels = sorted(place.wheelhouse.glob(f"ft-{VERSION}-*.whl"))
    if not wheels:
        raise PrepareError(f"pip built no wheel of ft {VERSION} into {place.wheelhouse}", hint=f"see {log}")
    return wheels[-1]


def tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def render_job(profile: ClusterProfile, place: EnvPlace, build: str, wheel: Path, base_python: str,
               offline: bool, time_minutes: int = 60) -> str:
    import platform

    from toolkit.render.sbatch import template_environment

    standard = profile.standard_tier
    return template_environment().get_template("prepare_env.sbatch.j2").render(
        version=VERSION, profile=profile, partition=standard.partition, qos=standard.qos,
        account=profile.default_account, time_limit=f"{time_minutes // 60:02d}:{time_minutes % 60:02d}:00",
        machine=platform.machine(), log=str(place.log(build)),
        target=str(place.venv(build)), wheelhouse=str(place.wheelhouse), base_python=base_python,
        offline=offline, requirement=f"{wheel}[train]", python_version=sys.version_info[:2],
        python_tag=f"cp{sys.version_info.major}{sys.version_info.minor}")


def submit_and_wait(script: Path, on_state: Callable[[str], None], timeout_s: float) -> tuple[str, str]:
    """sbatch the script; wait for its end. Returns (job id, final state)."""
    from toolkit.slurm.client import CliSlurmClient, wait_for_job

    job_id = slurm_jobs.submit(script, commands.run)
    info = wait_for_job(CliSlurmClient(), job_id, lambda info: on_state(f"job {job_id}: {info.describe()}"),
                        timeout_s)
    if info is None or not info.finished:
        slurm_jobs.cancel([job_id], commands.run, check=False)
        return job_id, "TIMEOUT (ft's wait; job cancelled)"
    return job_id, info.state


def prepare_venv(profile: ClusterProfile, base_python: str = "python3", offline: bool = True,
                 on_state: Callable[[str], None] = lambda _: None, timeout_minutes: int = 60) -> Path:
    """Build the venv on a compute node; returns its interpreter. Nothing is recorded on failure."""
    place = env_place(profile)
    build = build_id()
    venv = place.venv(build)
    if ready_build(venv / "bin" / "python") == build:
        return venv / "bin" / "python"
    on_state("gathering wheels on the login node (pip)")
    wheel = gather_wheels(place, place.wheels_log(build))
    script = place.script(build)
    write_atomically(script, render_job(profile, place, build, wheel, base_python, offline, timeout_minutes),
                     mode=0o700)
    job_id, state = submit_and_wait(script, on_state, timeout_minutes * 60 + 120)
    if state != "COMPLETED" or ready_build(venv / "bin" / "python") != build:
        raise PrepareError(f"the environment job {job_id} ended {state} without a complete environment:\n"
                           f"{tail(place.log(build))}",
                           hint=f"the job's log: {place.log(build)}; its script: {script}")
    return venv / "bin" / "python"


def prune(place: EnvPlace, current: Path, previous: str) -> tuple[list[Path], list[Path]]:
    """Remove this profile's older environments (a venv is about 2 GB) but the new one and the one
    recorded before it, with their scripts and logs. While jobs of this user are queued or running,
    nothing is removed (one of them may run an older environment: a requeued job keeps its
    script). Returns (kept, removed)."""
    keep = {current.parent.parent} | ({Path(previous).parent.parent} if previous else set())
    older = [venv for venv in place.folder.glob("ft-*") if venv.is_dir() and venv not in keep]
    if not older or user_has_jobs():
        return older, []
    for venv in older:
        shutil.rmtree(venv, ignore_errors=True)
        build = venv.name.removeprefix("ft-")
        for leftover in (place.script(build), place.log(build), place.wheels_log(build)):
            leftover.unlink(missing_ok=True)
    return [], older


def user_has_jobs() -> bool:
    listed = slurm_jobs.own_jobs(commands.run)
    return listed is None or bool(listed)
