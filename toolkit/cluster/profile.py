"""Cluster profiles: built in (lab, hyperpod, coreweave, oci), this site's (/etc/ft/cluster.yaml,
written by ft's Ansible role ft_profile), and the user's (~/.config/ft/clusters.yaml)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from toolkit.account.prices import PriceSite
from toolkit.base.errors import FtError
from toolkit.base.names import slurm_name
from toolkit.base.yaml_source import YamlError, load_trusted_yaml, load_yaml
from toolkit.checkpoint.cadence import CadenceSite
from toolkit.receipts.site import MonitoringSite
from toolkit.slurm.runtime import RuntimeSite
from toolkit.slurm.site import SchedulerSite
from toolkit.storage.site import StorageSite

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"


def site_profile_path() -> Path:
    """This site's profile, written by ft's Ansible role ft_profile."""
    return Path(os.environ.get("FT_SITE_PROFILE", "/etc/ft/cluster.yaml"))


class _Named(BaseModel):
    name: str

    _name = field_validator("name")(slurm_name)


# pydantic lists inherited fields from the last base to the first: in this order `ft cluster show`
# prints the name, then the scheduler's part, storage, runtime, monitoring, prices, the cadence's.
class ClusterProfile(CadenceSite, PriceSite, MonitoringSite, RuntimeSite, StorageSite, SchedulerSite, _Named):
    """A cluster, as one flat file section (the format users write is unchanged), made of the parts
    each reader needs, each typed beside what reads it: the scheduler and its tiers
    (toolkit/slurm/site.py), storage (toolkit/storage/site.py), fabric and containers
    (toolkit/slurm/runtime.py), monitoring and signing (toolkit/receipts/site.py), prices
    (toolkit/account/prices.py) and the nodes' failure rate (toolkit/checkpoint/cadence.py). A
    function that reads one part takes that part."""
    model_config = ConfigDict(extra="forbid")


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
