"""Cluster profiles: built in (lab, hyperpod, coreweave, oci), this site's (/etc/ft/cluster.yaml,
written by ft's Ansible role ft_profile), and the user's (~/.config/ft/clusters.yaml)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from toolkit.base.digests import key_id, public_key_bytes
from toolkit.base.errors import FtError
from toolkit.base.names import ENV_NAME_PATTERN, NAME_PATTERN
from toolkit.base.yaml_source import YamlError, load_trusted_yaml, load_yaml
from toolkit.checkpoint.cadence import DEFAULT_NODE_MTBF_HOURS
from toolkit.storage.object_store import parse_s3_url

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"


def site_profile_path() -> Path:
    """This site's profile, written by ft's Ansible role ft_profile."""
    return Path(os.environ.get("FT_SITE_PROFILE", "/etc/ft/cluster.yaml"))


# Characters a path on an #SBATCH line cannot carry: sbatch reads those lines without a shell, and
# expands '%' itself.
SBATCH_UNSAFE = "\n\r\"'\\ \t%"


def slurm_name(value: str | None) -> str | None:
    """Slurm names (partitions, QOS, accounts, clusters) reach #SBATCH lines: checked, not quoted,
    by the same rule as a recipe's names."""
    if value is not None and not re.fullmatch(NAME_PATTERN, value):
        raise ValueError(f"{value!r} is not a usable name: 1-63 letters, digits, '.', '_' or '-'")
    return value


class TierTarget(BaseModel):
    model_config = ConfigDict(extra="forbid")
    partition: str
    qos: str | None = None
    # The tier's own price per GPU-hour (a free tier's is lower, a premium one's higher); None: the profile's.
    price_per_gpu_hour: float | None = Field(None, ge=0, allow_inf_nan=False)

    _names = field_validator("partition", "qos")(slurm_name)


class AccountQuota(BaseModel):
    """An account's share of the cluster (the inventory's slurm_accounting_accounts, through ft_profile)."""
    model_config = ConfigDict(extra="forbid")
    # A month's GPU-hours: past the budget ft warns and flags the overage; past the cap ft refuses and
    # Slurm holds the jobs.
    budget_gpu_hours: float | None = Field(None, ge=0, allow_inf_nan=False)
    cap_gpu_hours: float | None = Field(None, ge=0, allow_inf_nan=False)
    max_running_jobs: int | None = Field(None, ge=0)  # runs at once; more wait in the queue


class ReceiptSigning(BaseModel):
    """The site's receipt signer (ansible/roles/ft_signer writes this section): the key `ft receipt
    verify` checks signatures with, and the socket a job asks for one on (toolkit/receipts)."""
    model_config = ConfigDict(extra="forbid")
    public_key: str  # base64 of the raw 32-byte ed25519 public key
    key_id: str  # the first 16 hex digits of its sha256: what a signature names
    socket: str = "/run/ft-signer/receipt.sock"
    # What the signers signed, per user and run, on the shared filesystem (None: not known here):
    # verify finds a receipt cut back to an earlier seal there.
    ledger: str | None = None

    @model_validator(mode="after")
    def key_id_is_the_key_s(self) -> ReceiptSigning:
        wanted = key_id(public_key_bytes(self.public_key))  # ValueError: not a public key
        if self.key_id != wanted:
            raise ValueError(f"key_id {self.key_id!r} is not this public key's ({wanted}): copy both from the "
                             "signer's key (python -m toolkit.receipts.keys KEYFILE)")
        return self

    @field_validator("socket", "ledger")
    @classmethod
    def socket_path(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith("/") or any(ch in value for ch in "\n\r\0")):
            raise ValueError(f"{value!r}: the signer's socket and ledger are absolute paths on one line")
        return value


class ClusterProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    gpus_per_node: int = Field(ge=0)
    # Workers per node where there are no GPUs (the lab: gloo on CPU). None: one per GPU.
    cpu_workers_per_node: int | None = None
    max_nodes: int | None = Field(None, ge=1)
    # The GPU nodes' size, for what a job asks of them: its share of their cores and memory (a job on
    # 2 of 8 GPUs asks for a quarter). None: not known (`ft cluster add` reads them from sinfo).
    cpus_per_node: int | None = Field(None, ge=1)
    memory_per_node_mb: int | None = Field(None, ge=1)
    # One GPU's memory, for the memory plan (toolkit/recipe/memory_plan.py): the resolver chooses
    # activation checkpointing and the ZeRO stage from it. None: not known (size rules instead).
    gpu_memory_gib: float | None = Field(None, gt=0, allow_inf_nan=False)
    # The site gives GPU nodes whole (HyperPod, SUNK, most GPU clouds): jobs ask --exclusive and all
    # of each node's memory.
    exclusive_nodes: bool = False
    fabric: str = "none"
    nccl_env: dict[str, str] = {}
    tiers: dict[str, TierTarget]
    shared_root: str = ""
    s3_prefix: str = ""
    # Where the site keeps models in its object store: <s3_models>/<org>--<name>[@revision]/ with ft's
    # manifest (`ft model push`). Fetched into the shared cache once per cluster.
    s3_models: str = ""
    # An S3-compatible endpoint (MinIO, SeaweedFS, a site's gateway); empty: AWS S3 itself.
    # AWS_ENDPOINT_URL in the environment overrides it.
    s3_endpoint: str = ""
    container_runtime: str = ""
    container_image: str = ""
    modules: list[str] = []
    srun_extra_args: list[str] = []
    price_per_gpu_hour: float = Field(0.0, ge=0, allow_inf_nan=False)
    # Whether compute nodes reach the internet. Without (the lab, air-gapped sites), W&B logs offline
    # and is synced from the login node (`wandb sync`), and `ft doctor` probes no public endpoint.
    compute_internet: bool = True
    # Mean time between failures of one node, for `checkpoint.every_minutes: auto` (the site's own
    # record, if it keeps one; the default follows published large-cluster interruption rates).
    node_mtbf_hours: float = Field(DEFAULT_NODE_MTBF_HOURS, gt=0)
    default_account: str | None = None
    accounts: dict[str, AccountQuota] = {}
    # How the compute nodes get ft and the training stack (`ft cluster prepare`):
    #   ""         the site's: ft installed where the login node's interpreter also runs (the lab,
    #              an admin's shared install); jobs run the login node's Python unless `python` says
    #   venv       a venv on the shared filesystem, built on a compute node; `python` is its interpreter
    #   container  `container_image` holds ft[train]; jobs run `python` (default python3) inside it
    environment: Literal["", "venv", "container"] = ""
    python: str = ""
    # The site's receipt signer; None: runs' receipts stay unsigned (`ft receipt verify` says so).
    receipts: ReceiptSigning | None = None

    _names = field_validator("name", "default_account")(slurm_name)

    @field_validator("shared_root")
    @classmethod
    def shared_root_path(cls, value: str) -> str:
        # Run directories live under it and reach #SBATCH lines, which sbatch reads without a shell
        # and where it expands '%' itself.
        if value and (not value.startswith(("/", "~")) or any(ch in value for ch in SBATCH_UNSAFE)):
            raise ValueError(f"{value!r}: the shared root is an absolute path without spaces, quotes or '%'")
        return value

    @field_validator("fabric")
    @classmethod
    def fabric_name(cls, value: str) -> str:
        if not re.fullmatch(r"[a-z0-9_-]{1,32}", value):
            raise ValueError(f"{value!r} is not a fabric name (efa, infiniband, roce, none...)")
        return value

    @field_validator("s3_prefix", "s3_models")
    @classmethod
    def s3_prefix_url(cls, value: str) -> str:
        if value:
            parse_s3_url(value, "an S3 prefix")
        return value

    @field_validator("s3_endpoint")
    @classmethod
    def endpoint_url(cls, value: str) -> str:
        if value and not re.fullmatch(r"https?://[A-Za-z0-9.:\[\]_-]+(/[A-Za-z0-9._~/-]*)?", value):
            raise ValueError(f"{value!r} is not an http(s):// endpoint URL (scheme, host, optional port and path)")
        return value

    @field_validator("nccl_env")
    @classmethod
    def env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not re.fullmatch(ENV_NAME_PATTERN, name, re.ASCII):
                raise ValueError(f"{name!r} is not a valid environment variable name")
        return value

    @field_validator("python")
    @classmethod
    def python_path(cls, value: str) -> str:
        if value and any(ch in value for ch in "\n\r\0"):
            raise ValueError(f"{value!r}: an interpreter path is one line")
        return value

    @field_validator("tiers")
    @classmethod
    def has_standard_tier(cls, value: dict[str, TierTarget]) -> dict[str, TierTarget]:
        if "standard" not in value:
            raise ValueError("a profile needs at least the standard tier (tiers.standard.partition)")
        return value

    @field_validator("container_runtime")
    @classmethod
    def known_runtime(cls, value: str) -> str:
        if value not in ("", "pyxis"):
            raise ValueError(f"{value!r}: ft runs containers through pyxis (srun --container-image); '' for none")
        return value

    @model_validator(mode="after")
    def container_has_image(self) -> ClusterProfile:
        if self.environment == "container" and not (self.container_runtime and self.container_image):
            raise ValueError("environment 'container' needs container_runtime (pyxis) and container_image")
        if self.environment == "venv" and not self.python:
            raise ValueError("environment 'venv' needs python: the venv's interpreter (`ft cluster prepare` sets it)")
        return self

    def training_python(self, login_python: str) -> str:
        """The interpreter a job runs ft with on the compute nodes: the recorded one, else the
        image's python3 inside a container (the login node's path does not exist there), else the
        login node's own (an install the compute nodes share)."""
        if self.python:
            return self.python
        return "python3" if self.in_container else login_python

    def batch_python(self, login_python: str) -> str:
        """The interpreter of the job script's own steps on the batch host (registering the run, the
        watchdog, the requeue helper): pyxis puts only srun's steps in the container, so there it is
        the login node's install, which must sit on a filesystem the compute nodes share."""
        return login_python if self.in_container else (self.python or login_python)

    @property
    def in_container(self) -> bool:
        """Whether srun's steps run in the profile's image: a venv of its own (`ft cluster prepare`
        on a profile that extends a container one) runs on the host, where it was built."""
        return self.environment != "venv" and bool(self.container_runtime and self.container_image)

    @property
    def standard_tier(self) -> TierTarget:
        """Where ft's own short jobs (the environment build, doctor's preflight) run."""
        return self.tiers["standard"]

    @property
    def distributed_backend(self) -> str:
        return "gloo" if self.cpu_workers_per_node else "nccl"


class ProfileError(FtError):
    exit_code = 2


# Fields ft's Ansible role ft_profile wrote until nothing read them: a site profile written then
# still loads (re-running the role drops them).
RETIRED_FIELDS = ("slurm_cluster", "gpu_model")


def _parse(data: dict, origin: str) -> ClusterProfile:
    data = {key: value for key, value in data.items() if key not in RETIRED_FIELDS}
    try:
        return ClusterProfile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        where = f"cluster profile field {field}" if field else "cluster profile"
        raise ProfileError(f"{origin}: {where}: {first['msg'].removeprefix('Value error, ')}") from None


def _read(path: Path) -> object:
    try:
        return load_yaml(path, "cluster profile")[0]
    except YamlError as exc:
        raise ProfileError(exc.message, hint=exc.hint) from None


def user_profiles_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return Path(os.environ.get("FT_CLUSTERS_FILE", os.path.join(base, "ft", "clusters.yaml")))


def base_profiles() -> dict[str, ClusterProfile]:
    """The built-in profiles, then this site's over them."""
    profiles: dict[str, ClusterProfile] = {}
    for path in sorted(BUILTIN_DIR.glob("*.yaml")):
        profile = _parse(load_trusted_yaml(path), str(path))
        profiles[profile.name] = profile
    site_path = site_profile_path()
    if site_path.is_file():
        site = _read(site_path) or {}
        if isinstance(site, dict):
            base = profiles.get(site.get("name", ""))
            merged = (base.model_dump() if base else {}) | {k: v for k, v in site.items() if v not in ("", None)}
            profile = _parse(merged, str(site_path))
            profiles[profile.name] = profile
    return profiles


def resolve_user_entries(entries: dict, base: dict[str, ClusterProfile], origin: str
                         ) -> tuple[dict[str, ClusterProfile], dict[str, ProfileError]]:
    """The user's entries over the base profiles, each after the entry it extends (whatever their
    order in the file). An entry that extends its own name extends the base profile of that name. A
    broken entry (and those extending it) is set apart with its error: it never hides the others."""
    profiles = dict(base)
    errors: dict[str, ProfileError] = {}
    done: set[str] = set()

    def resolve(name: str, chain: tuple[str, ...]) -> None:
        if name in done:
            return
        body = entries[name]
        parent = body.get("extends") if isinstance(body, dict) else None
        try:
            if name in chain:
                raise ProfileError(f"{origin}: profiles extend each other in a loop: {' -> '.join((*chain, name))}",
                                   hint="make one of them extend a built-in profile (lab, hyperpod, ...)")
            if parent in entries and parent != name:
                resolve(parent, (*chain, name))
                if parent in errors:
                    raise ProfileError(f"{origin}: profile {name} extends {parent}, which is broken: "
                                       f"{errors[parent].message}")
            profiles[name] = user_profile(name, body, base if parent == name else profiles, origin)
        except ProfileError as exc:
            errors[name] = exc
            if name in base:
                profiles[name] = base[name]  # `ft cluster ls` still lists it; load_profile raises the error
            else:
                profiles.pop(name, None)
        done.add(name)

    for name in entries:
        resolve(name, ())
    return profiles, errors


def load_all() -> tuple[dict[str, ClusterProfile], dict[str, ProfileError]]:
    """Every profile by name (later sources override earlier: built in, site, user), and the user's
    entries that are broken, with why."""
    base = base_profiles()
    path = user_profiles_path()
    return resolve_user_entries(read_user_entries(), base, str(path)) if path.is_file() else (base, {})


def available_profiles() -> dict[str, ClusterProfile]:
    return load_all()[0]


def user_profile(name: str, body: object, profiles: dict[str, ClusterProfile], origin: str) -> ClusterProfile:
    """One entry of the user's profiles file: its fields over those of the profile it `extends`."""
    if not isinstance(body or {}, dict):
        raise ProfileError(f"{origin}: profile {name!r} is not a mapping of fields")
    body = dict(body or {})
    parent = body.pop("extends", None)
    base = profiles.get(parent).model_dump() if parent in profiles else {}
    if parent and not base:
        raise ProfileError(f"{origin}: profile {name} extends unknown profile {parent!r}",
                           hint=f"known profiles: {', '.join(sorted(profiles))}")
    return _parse(base | body | {"name": name}, f"{origin} ({name})")


def read_user_entries() -> dict:
    """The user's profiles file as written: name -> fields (with `extends`)."""
    path = user_profiles_path()
    entries = _read(path) if path.is_file() else {}
    if not isinstance(entries or {}, dict):
        raise ProfileError(f"{path}: expected a mapping of profile name to profile",
                           hint=f"fix or remove {path}")
    return dict(entries or {})


def update_user_entry(name: str, change: Callable[[dict | None], dict | None]) -> ClusterProfile | None:
    """Read, change and write one entry of the user's profiles file under a lock (two `ft cluster`
    commands at once lose neither's change): `change` gets the entry (None: there is none) and
    returns the new one (None: remove it). The whole file is checked before it is written, and
    nothing is written when any entry would be broken. The other entries are kept (their comments
    are not)."""
    import fcntl

    import yaml

    from toolkit.base.shared_dirs import write_atomically

    path = user_profiles_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = read_user_entries()
        base = base_profiles()
        broken_before = set(resolve_user_entries(entries, base, str(path))[1])
        body = change(entries.get(name))
        if body is None:
            entries.pop(name, None)
        else:
            entries[name] = body
        profiles, errors = resolve_user_entries(entries, base, str(path))
        # Refused: a change that breaks its entry or another one; an entry broken before (by a hand
        # edit) does not stop changes to the others, nor its own mending or removal.
        new_errors = {key: error for key, error in errors.items() if key == name or key not in broken_before}
        if new_errors:
            first = new_errors.get(name) or next(iter(new_errors.values()))
            raise ProfileError(f"not changed: {first.message}", hint=first.hint)
        write_atomically(path, "# ft's cluster profiles for this user (`ft cluster add`, `ft cluster set`).\n"
                         + yaml.safe_dump(entries, sort_keys=False))
    return profiles.get(name) if body is not None else None


def site_profile_name() -> str | None:
    """The name of this site's profile, when ft's Ansible wrote one."""
    if site_profile_path().is_file():
        site = _read(site_profile_path())
        if isinstance(site, dict) and site.get("name"):
            return str(site["name"])
    return None


def default_profile_name() -> str:
    """This site's profile when ft's Ansible wrote one, else the local lab."""
    return site_profile_name() or "lab"


def load_profile(name: str | None) -> ClusterProfile:
    profiles, errors = load_all()
    wanted = name or default_profile_name()
    if wanted in errors:
        raise errors[wanted]
    if wanted not in profiles:
        import difflib

        close = difflib.get_close_matches(wanted, profiles, n=1)
        raise ProfileError(f"unknown cluster profile {wanted!r}",
                           hint=(f"did you mean {close[0]!r}? " if close else "")
                           + f"known profiles: {', '.join(sorted(profiles))}")
    return profiles[wanted]
