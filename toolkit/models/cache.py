"""Where models are cached on a cluster, in the order they are looked up: node-local disk, the
shared filesystem, the site's object store (profile `s3_models`); the hub comes after, only where the
site allows it (toolkit/train/models.py). Read by both sides: validation finds a model's tokenizer
here, workers its weights.

A model is fetched from the object store once per cluster (into the shared tier, under a lock every
node sees) and copied to node-local disk once per node (under that node's lock), so a job of many
ranks on many nodes asks the slower tiers once. Each copy is built in a staging folder, checked and
renamed into place: a download is verified file by file against its manifest (sha256), a node-local
copy against its source's sizes, and both must pass the structural check of a model folder. An
entry ft made (it carries ft's mark) and that is no longer whole is replaced; a broken entry that
someone else put there is refused, naming it and the fix.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from toolkit.base.cache_entries import discard, exclusive, staging_path
from toolkit.base.shared_dirs import shared_root_path, trusted_owner_dir
from toolkit.models.folder import model_folder_problems
from toolkit.storage.object_store import ObjectStore, within

COPY_MARK = ".ft-copy"  # in a node-local copy: where it came from, and its size
DOWNLOAD_MARK = "manifest.json"  # in a copy from the object store: its manifest, as verified
LOCAL_ROOM = 1.1  # a node-local copy is made only where this much of its size is free


class ModelFolderBroken(RuntimeError):
    """A model in the cache that is not whole: never loaded, and never repaired behind the user's back
    (a real model is not ft's to rebuild)."""


def local_models() -> Path:
    """The node-local tier: per user by default (FT_MODEL_CACHE_LOCAL sets another)."""
    return Path(os.environ.get("FT_MODEL_CACHE_LOCAL") or f"/tmp/ft-model-cache-{os.getuid()}")


def shared_models(shared_root: str) -> Path:
    """The shared filesystem's tier, which the site's admins fill (and ft, from the object store or
    the hub)."""
    return shared_root_path(shared_root) / "models"


def cache_dirs(shared_root: str) -> list[Path]:
    """The model cache tiers to read, node-local first. A tier is read only when it is a real folder
    of root's or this user's (another user could plant a model, and its chat template, in a folder
    of theirs that has a name ft looks for)."""
    return [tier for tier in (local_models(), shared_models(shared_root)) if trusted_owner_dir(tier)]


def entry_name(base: str, revision: str | None) -> str:
    """A model's folder name in every tier: one path part, whatever '/' the id and revision hold."""
    return base.replace("/", "--") + (f"@{revision.replace('/', '--')}" if revision else "")


def made_by_ft(entry: Path) -> bool:
    return (entry / COPY_MARK).is_file() or (entry / DOWNLOAD_MARK).is_file()


def usable(entry: Path, warn: Callable[[str], None]) -> bool:
    """Whether a tier's entry is there and whole. One ft made that is not whole is discarded (and
    fetched again); one someone else put there is refused."""
    if not os.path.lexists(entry):
        return False
    problems = model_folder_problems(entry)
    if not problems and (entry / COPY_MARK).is_file():
        problems = copy_problems(entry)
    if not problems:
        return True
    if made_by_ft(entry):
        warn(f"the cached model {entry} is not whole ({'; '.join(problems)}): fetching it again")
        discard(entry)
        return False
    raise ModelFolderBroken(
        f"the cached model {entry} is not whole: {'; '.join(problems)}. Copy the model there again (to a new "
        f"folder, then rename it into place), or delete {entry} to use the next cache tier")


def folder_bytes(folder: Path) -> int:
    """The bytes a node-local copy holds of its source: dot files and folders (a download's .cache,
    .gitattributes, ft's own mark) are not copied, so not counted."""
    return sum(p.stat().st_size for p in folder.rglob("*")
               if p.is_file() and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def copy_problems(entry: Path) -> list[str]:
    try:
        expected = int(json.loads((entry / COPY_MARK).read_text())["bytes"])
    except (OSError, ValueError, KeyError, TypeError):
        return [f"{COPY_MARK} is unreadable"]
    size = folder_bytes(entry)
    return [] if size == expected else [f"it holds {size} bytes, its source {expected}"]


def sweep_leftovers(tier: Path, name: str) -> None:
    """The staging folders of this entry that a builder on this host left when it died (a full disk,
    a kill): named by staging_path, with the builder's pid, which no longer runs."""
    import re
    import socket

    builder = re.escape(f"{name}-{socket.gethostname()}")
    pattern = re.compile(rf"\.(copying|download)-{builder}-(\d+)-[0-9a-f]{{6}}")
    for leftover in tier.iterdir():
        match = pattern.fullmatch(leftover.name)
        if match and not Path(f"/proc/{match.group(2)}").exists():
            discard(leftover)


def copy_to_local(source: Path, local: Path, log: Callable[[str], None]) -> Path:
    """The node-local copy of a whole entry, made once per node; `source` itself where the node-local
    tier is unusable or has no room."""
    target = local / source.name
    if not trusted_owner_dir(local):
        return source
    try:
        local.mkdir(parents=True, exist_ok=True, mode=0o700)
        with exclusive(local / f".{source.name}.lock"):
            if usable(target, log):
                return target
            size = folder_bytes(source)
            if shutil.disk_usage(local).free < size * LOCAL_ROOM:
                log(f"model {source.name}: no room on node-local disk for {size / 1e9:.1f} GB: read from {source}")
                return source
            started = time.monotonic()
            sweep_leftovers(local, source.name)
            staging = staging_path(target, "copying")
            try:
                shutil.copytree(source, staging, ignore=shutil.ignore_patterns(".*"))
                (staging / COPY_MARK).write_text(json.dumps({"from": str(source), "bytes": size}) + "\n")
            except BaseException:
                discard(staging)  # a full disk leaves no half copy behind
                raise
            problems = model_folder_problems(staging) or copy_problems(staging)
            if problems:
                discard(staging)
                log(f"warning: the node-local copy of {source} is not whole ({'; '.join(problems)}): read from "
                    f"{source}")
                return source
            staging.rename(target)
            log(f"model {source.name}: copied to node-local disk ({size / 1e6:.0f} MB in "
                f"{time.monotonic() - started:.1f} s)")
            return target
    except OSError as exc:  # a full or read-only local disk: the shared copy serves
        log(f"warning: model {source.name} could not be copied to {local} ({exc}): read from {source}")
        return source


def fetch_from_store(name: str, models_url: str, tier: Path, log: Callable[[str], None],
                     shared_root: str, store: ObjectStore) -> Path | None:
    """Bring a model from the object store into a tier (the shared one: once per cluster; the first
    node to ask downloads it, verified, while the others wait on the lock and then find it whole).
    Its manifest must be the one its pusher's record names (toolkit/models/records.py). None when the
    store does not have it."""
    from toolkit.checkpoint.remote import RemoteProblem, get_folder
    from toolkit.models import records as model_records

    filesystem, base = store.filesystem(f"{models_url.rstrip('/')}/{name}")
    target = tier / name
    tier.mkdir(parents=True, exist_ok=True)
    with exclusive(tier / f".{name}.lock"):
        if usable(target, log):
            return target
        sweep_leftovers(tier, name)
        started = time.monotonic()
        staging = staging_path(target, "download")
        try:
            described = get_folder(filesystem, base, staging,
                                   vouch=lambda raw: model_records.check(shared_root, name, raw))
        except RemoteProblem as exc:
            if "has no manifest" in str(exc):
                return None
            raise ModelFolderBroken(f"model {name} in {models_url} cannot be used: {exc}") from None
        problems = model_folder_problems(staging)
        if problems:
            discard(staging)
            raise ModelFolderBroken(f"model {name} in {models_url} is not a usable model folder: {'; '.join(problems)}")
        staging.rename(target)
        log(f"model {name}: fetched from {models_url} into {tier} ({described.total_bytes / 1e6:.0f} MB in "
            f"{time.monotonic() - started:.1f} s, verified)")
        return target


def find_model(name: str, shared_root: str, models_url: str, log: Callable[[str], None],
               store: ObjectStore | None = None) -> tuple[Path | None, list[str]]:
    """The model from the nearest tier that has it whole, on node-local disk where it fits; and the
    places looked in (for a message when none has it). `store` reaches `models_url` (by default,
    the store the environment names: in a job, the one its script exports from the profile)."""
    local, shared = local_models(), shared_models(shared_root)
    looked = []
    if trusted_owner_dir(local):
        looked.append(str(local / name))
        if usable(local / name, log):
            log(f"model {name}: from node-local disk ({local})")
            return local / name, looked
    if trusted_owner_dir(shared):
        looked.append(str(shared / name))
        if usable(shared / name, log):
            return copy_to_local(shared / name, local, log), looked
    if models_url:
        looked.append(f"{models_url.rstrip('/')}/{name}")
        # Into the shared tier (once per cluster) where this user may write there, else this node's.
        into = shared if trusted_owner_dir(shared) and writable(shared) else local if trusted_owner_dir(local) else None
        fetched = fetch_from_store(name, models_url, into, log, shared_root, store or ObjectStore()) if into else None
        if fetched is not None:
            return (copy_to_local(fetched, local, log) if into == shared else fetched), looked
    return None, looked


def writable(folder: Path) -> bool:
    """Whether this user may create entries in a folder (or create the folder: its nearest ancestor)."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return os.access(existing, os.W_OK | os.X_OK)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
TOKENIZER_WAIT_S = 30.0  # a login-side check never waits longer on the object store


def fetch_tokenizer(name: str, models_url: str, cache: Path, shared_root: str, store: ObjectStore) -> Path | None:
    """The tokenizer files of a model the object store holds (not its weights), into `cache` (the
    user's own), each verified against the model's manifest, and the manifest against its pusher's
    record: what validation needs on the login node to count tokens. None when the store has no such
    model, or does not answer in time."""
    answer = within(lambda: _fetch_tokenizer(name, models_url, cache, shared_root, store), TOKENIZER_WAIT_S)
    return answer.value if answer.in_time and not answer.error else None


def _fetch_tokenizer(name: str, models_url: str, cache: Path, shared_root: str, store: ObjectStore) -> Path | None:
    """The store's trouble (no such model, no record, credentials, the endpoint) raises: `within`
    makes it None."""
    from toolkit.base.digests import sha256_file
    from toolkit.checkpoint.remote import read_manifest
    from toolkit.models import records as model_records

    target = cache / "tokenizers" / name
    if (target / "tokenizer.json").is_file():
        return target
    filesystem, base = store.filesystem(f"{models_url.rstrip('/')}/{name}")
    described = read_manifest(filesystem, base, lambda raw: model_records.check(shared_root, name, raw))
    staging = staging_path(target, "download")
    staging.mkdir(parents=True)
    try:
        for file in TOKENIZER_FILES:
            entry = described.files.get(file)
            if entry is None:
                continue
            filesystem.get_file(f"{base}/{file}", str(staging / file))
            if (staging / file).stat().st_size != entry.bytes or sha256_file(staging / file) != entry.sha256:
                return None
        if not (staging / "tokenizer.json").is_file():
            return None
        staging.rename(target)
        return target
    finally:
        discard(staging)  # what is left of it: nothing once renamed into place
