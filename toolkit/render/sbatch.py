"""Render a run's sbatch script. Deterministic: the same recipe, profile and run id give the same
bytes. Every user-supplied string reaches the shell quoted, and no secret value is ever written."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import jinja2
import jinja2.bccache

from toolkit.base.build import VERSION
from toolkit.base.errors import FtError
from toolkit.base.names import RUN_ID_PATTERN, SBATCH_UNSAFE
from toolkit.base.paths import resource_dir
from toolkit.base.shared_dirs import SharedFolderError, private_dir
from toolkit.recipe.job_plan import SitePlan, StepPlan
from toolkit.recipe.resolve import ResolvedRecipe
from toolkit.recipe.run_spec import RunSpec
from toolkit.render.node_request import node_request
from toolkit.runs import layout
from toolkit.slurm import job_comment

# Names passed from the submitting environment, by name only.
SECRET_NAMES = ("WANDB_API_KEY", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN")


class RenderError(FtError):
    exit_code = 2


@dataclass(frozen=True)
class RunPlacement:
    run_id: str
    run_dir: str
    idempotency_key: str | None = None


_PLAIN_WORD = re.compile(r"[A-Za-z0-9_./:@%+,-]+")


def shell_quote(value: object) -> str:
    """One shell word that means exactly `value`. Stricter than shlex.quote: a leading '=' or
    '^' (NCCL's "exact match" and "exclude" prefixes) is quoted too, so readers never wonder."""
    text = str(value)
    if _PLAIN_WORD.fullmatch(text):
        return text
    return "'" + text.replace("'", "'\"'\"'") + "'"


def sbatch_path(path: str) -> str:
    """A folder for an #SBATCH line, which sbatch reads without a shell: it must stand alone, and
    hold no '%' (sbatch would expand %j, %u... there, while the run directory keeps them literally)."""
    if any(ch in path for ch in SBATCH_UNSAFE):
        raise RenderError(f"the run directory {path!r} holds a space, quote, newline or '%', which an #SBATCH "
                          "line cannot carry as is", hint="choose a run directory (shared_root) without them")
    return path


def environment(resolved: ResolvedRecipe) -> list[tuple[str, str]]:
    """Fabric variables from the profile, then the recipe's (which win)."""
    merged = dict(resolved.profile.nccl_env)
    merged.update(resolved.recipe.env)
    return sorted(merged.items())


def site_plan(resolved: ResolvedRecipe) -> SitePlan:
    """What the job takes from the cluster profile (toolkit/recipe/job_plan.py)."""
    profile = resolved.profile
    return SitePlan(cluster=profile.name, shared_root=profile.shared_root,
                    distributed_backend=profile.distributed_backend, s3_prefix=profile.s3_prefix,
                    s3_models=profile.s3_models,
                    monitoring_targets=f"{profile.shared_root}/monitoring/targets" if profile.shared_root else "",
                    receipt_signer=str(profile.receipts.socket) if profile.receipts else "")


def step_plan(resolved: ResolvedRecipe, login_python: str, whole_nodes: bool) -> StepPlan:
    """The training step the job starts (toolkit/recipe/job_plan.py): the profile's interpreter and srun options."""
    options = list(resolved.profile.srun_extra_args)
    if resolved.profile.container_runtime == "pyxis" and resolved.profile.container_image:
        options += [f"--container-image={resolved.profile.container_image}",
                    f"--container-mounts={resolved.profile.shared_root}", "--container-workdir=/"]
    return StepPlan(python=resolved.profile.training_python(login_python), srun_options=options,
                    whole_nodes=whole_nodes)


class PrivateBytecodeCache(jinja2.FileSystemBytecodeCache):
    """jinja2's file cache, trusting an entry only when it is this user's own regular file that
    nobody else may write (an entry is unpickled, then run: one planted by another user would run
    as this one), and never failing a render: an entry that cannot be read or written is compiled
    anew."""

    def load_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            descriptor = os.open(self._get_cache_filename(bucket), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return
        with os.fdopen(descriptor, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o022:
                return
            try:
                bucket.load_bytecode(handle)
            except Exception:  # noqa: BLE001 - a damaged entry: compile the template instead
                bucket.reset()

    def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        with contextlib.suppress(OSError):  # a full or read-only home: the next render compiles again
            super().dump_bytecode(bucket)


def template_cache() -> jinja2.BytecodeCache | None:
    """The job script's template, compiled, kept per user: compiling it took 31 ms of every
    `ft render`. jinja2 checks an entry against its template's source (checksum) and this Python's
    bytecode version. None (compile each time) where there is no private folder to be had; a
    relative XDG_CACHE_HOME is ignored, as the XDG specification says."""
    configured = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(configured) if os.path.isabs(configured) else Path.home() / ".cache"
    try:
        base.mkdir(parents=True, exist_ok=True)
        folder = private_dir(private_dir(base / "ft") / "templates")
    except (SharedFolderError, OSError):
        return None
    return PrivateBytecodeCache(str(folder))


def template_environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(resource_dir("sbatch_templates"))),
        bytecode_cache=template_cache(),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["q"] = shell_quote
    env.globals["sbatch_path"] = sbatch_path
    return env


# --gpus-per-node arrived in Slurm 19.05; older controllers only understand --gres.
GPUS_PER_NODE_SINCE = (19, 5, 0)


def render(resolved: ResolvedRecipe, placement: RunPlacement, mode: str = "train", login_python: str | None = None,
           slurm_version: tuple[int, int, int] | None = None) -> str:
    """The job script. `slurm_version`, when known (detected on the cluster), picks the options this
    Slurm understands; unknown means a current Slurm. `login_python` stands in for this process's
    interpreter where the profile records no training environment (golden files)."""
    if not RUN_ID_PATTERN.fullmatch(placement.run_id):
        raise RenderError(f"run id {placement.run_id!r} is not typeable",
                          hint="use letters, digits, '.', '_' and '-'")
    key = placement.idempotency_key
    node = node_request(resolved)
    step = step_plan(resolved, login_python or sys.executable, node.exclusive)
    spec = RunSpec(recipe=resolved.recipe, derived=resolved.derived, site=site_plan(resolved), step=step)
    context = {
        "version": VERSION,
        "recipe": resolved.recipe,
        "profile": resolved.profile,
        "run_id": placement.run_id,
        "run_dir": placement.run_dir,
        "mode": mode,
        "job_name": f"ft-{placement.run_id}"[:120],
        "partition": resolved.derived.partition,
        "qos": resolved.derived.qos,
        "gres_gpus": resolved.recipe.resources.gpus_per_node,
        "gpus_as_gres": slurm_version is not None and slurm_version < GPUS_PER_NODE_SINCE,
        "workers_per_node": resolved.derived.workers_per_node,
        "node": node,
        "world_size": resolved.derived.world_size,
        "pre_timeout_seconds": resolved.recipe.checkpoint.before_time_limit,
        "comment": job_comment.compose(placement.run_id, key),
        "modules": resolved.profile.modules,
        "environment": environment(resolved),
        "secret_names": SECRET_NAMES,
        "batch_python": resolved.profile.batch_python(login_python or sys.executable),
        "files": layout.TEMPLATE_NAMES,
        "spec_json": json.dumps(spec.model_dump(mode="json"), indent=2, sort_keys=True),
    }
    return template_environment().get_template("job.sbatch.j2").render(context)
