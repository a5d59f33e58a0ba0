"""A LoRA adapter folder, as the registry takes it in: flat, regular files only, bounded, with
adapter_config.json (peft_type LORA) and safetensors weights. The files are hashed as they are
copied, so the version's id is the hash of what the registry holds, not of what the folder held a
moment before (a run's output is its owner's to change).

The version id: the sha256 of the `sha256sum` lines of the files ("<sha256>  <name>\\n"), names in
byte order; in the version's adapter/ folder, `sha256sum $(LC_ALL=C ls) | sha256sum` gives it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from toolkit.base.errors import FtError
from toolkit.models.folder import safetensors_problem
from toolkit.registry.records import FileDigest, LoraShape

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# A full fine-tune's folder: weights a server loads as a model, never beside one.
FULL_MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
MAX_FILES = 64  # an adapter, its tokenizer and a card are about ten
MAX_ADAPTER_BYTES = 16 << 30  # a rank-64 LoRA of a 70B model is a few GB
MAX_CONFIG_BYTES = 1 << 20
BLOCK = 1 << 20
_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,199}")  # no hidden files, nothing a shell or a URL reads
_KINDS = ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))


class AdapterRefused(FtError):
    """A folder the registry does not take: bad input, nothing was registered."""

    exit_code = 2


def _kind(mode: int) -> str:
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def adapter_files(folder: Path) -> list[str]:
    """The names of an adapter folder's files, sorted; AdapterRefused, saying what, for anything that is
    not a whole LoRA adapter: a symlink, a subfolder, a FIFO or a device in it, too many files or bytes,
    no adapter_config.json or no weights (a full fine-tune's weights are a model, not an adapter)."""
    try:
        info = os.lstat(folder)
    except OSError as exc:
        raise AdapterRefused(f"{folder} cannot be read ({exc.strerror or exc})") from None
    if not stat.S_ISDIR(info.st_mode):
        raise AdapterRefused(f"{folder} is {_kind(info.st_mode)}, not an adapter folder")
    names, total = [], 0
    with os.scandir(folder) as entries:
        for entry in entries:
            if len(names) == MAX_FILES:
                raise AdapterRefused(f"{folder} holds more than {MAX_FILES} files: not an adapter folder")
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(info.st_mode):
                raise AdapterRefused(f"{folder / entry.name} is {_kind(info.st_mode)}: an adapter folder holds "
                                     "regular files only", hint="register the adapter's own folder (the run's output/)")
            if not _PLAIN.fullmatch(entry.name):
                raise AdapterRefused(f"{folder} holds {entry.name!r}: file names in an adapter are plain "
                                     "(letters, digits, '.', '_', '+', '-'; no hidden files)")
            names.append(entry.name)
            total += info.st_size
    if total > MAX_ADAPTER_BYTES:
        raise AdapterRefused(f"{folder} holds {total / 2**30:.1f} GiB: over the registry's "
                             f"{MAX_ADAPTER_BYTES >> 30} GiB for one adapter")
    missing = [name for name in (CONFIG, WEIGHTS) if name not in names]
    if CONFIG in missing and any(name in names for name in FULL_MODEL_FILES):
        raise AdapterRefused(f"{folder} holds a model's weights, not a LoRA adapter (no {CONFIG}): the "
                             "registry keeps adapters that a serving fleet loads beside their base model",
                             hint="a full fine-tune is served as a model of its own (ft model push)")
    if missing:
        raise AdapterRefused(f"{folder} is not a LoRA adapter: {' and '.join(missing)} missing",
                             hint=f"peft's save_pretrained writes {CONFIG} and {WEIGHTS} (safetensors; a pickled "
                                  "adapter_model.bin is not taken: loading it runs code)")
    return sorted(names)


def open_descriptor(path: Path) -> tuple[int, int]:
    """A file opened for reading only when it is a regular one, never through a symlink; with its size."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode):
        os.close(descriptor)
        raise OSError(f"{path} is {_kind(info.st_mode)}, not a regular file")
    return descriptor, info.st_size


def stream(descriptor: int, size: int, path: Path, write: Callable[[bytes], object] | None = None) -> FileDigest:
    """Read exactly `size` bytes, hashing them (and handing them to `write`): a file that grows or
    shrinks meanwhile is refused, never taken half."""
    digest, left = hashlib.sha256(), size
    while left:
        block = os.read(descriptor, min(BLOCK, left))
        if not block:
            raise AdapterRefused(f"{path} shrank while it was read: it is still being written")
        digest.update(block)
        if write is not None:
            write(block)
        left -= len(block)
    if os.read(descriptor, 1):
        raise AdapterRefused(f"{path} grew while it was read: it is still being written")
    return FileDigest(bytes=size, sha256=digest.hexdigest())


def _write_all(descriptor: int, block: bytes) -> None:
    view = memoryview(block)
    while view:
        view = view[os.write(descriptor, view):]


def copy_in(source: Path, names: list[str], destination: Path) -> dict[str, FileDigest]:
    """Copy an adapter's files into `destination` (a new folder of this user's), hashed as they are
    copied, within the registry's bound on bytes."""
    files, budget = {}, MAX_ADAPTER_BYTES
    for name in names:
        descriptor, size = open_descriptor(source / name)
        try:
            if size > budget:
                raise AdapterRefused(f"{source} grew past the registry's {MAX_ADAPTER_BYTES >> 30} GiB for one adapter")
            out = os.open(destination / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o444)
            try:
                files[name] = stream(descriptor, size, source / name, lambda block, out=out: _write_all(out, block))
                os.fsync(out)
            finally:
                os.close(out)
        finally:
            os.close(descriptor)
        budget -= size
    return files


def digest_of(path: Path, write: Callable[[bytes], object] | None = None) -> FileDigest:
    descriptor, size = open_descriptor(path)
    try:
        return stream(descriptor, size, path, write)
    finally:
        os.close(descriptor)


def read_bounded(path: Path, limit: int) -> bytes:
    """A small file of the registry (a record, a handoff), read only when it is a regular one of at most
    `limit` bytes."""
    descriptor, size = open_descriptor(path)
    try:
        if size > limit:
            raise OSError(f"{path} is over {limit} bytes")
        return os.read(descriptor, limit + 1)
    finally:
        os.close(descriptor)


def content_id(files: dict[str, FileDigest]) -> str:
    lines = "".join(f"{files[name].sha256}  {name}\n" for name in sorted(files))
    return hashlib.sha256(lines.encode()).hexdigest()


def lora_shape(folder: Path) -> LoraShape:
    """The LoRA's rank, alpha and modules from its adapter_config.json (a copy of the registry's own);
    AdapterRefused for a config that is not a LoRA's, or weights that are not whole safetensors."""
    try:
        config = json.loads(read_bounded(folder / CONFIG, MAX_CONFIG_BYTES))
    except (OSError, ValueError, RecursionError):
        config = None
    if not isinstance(config, dict):
        raise AdapterRefused(f"{CONFIG} is not a JSON object of at most {MAX_CONFIG_BYTES >> 20} MiB")
    if config.get("peft_type") != "LORA":
        raise AdapterRefused(f"{CONFIG} is a {config.get('peft_type')!r} adapter: the registry takes LoRA adapters, "
                             "which serving fleets load (vLLM, LoRAX, TGI)")
    try:
        shape = LoraShape(rank=config.get("r"), alpha=config.get("lora_alpha"),
                          target_modules=config.get("target_modules"))
    except ValidationError as exc:
        first = exc.errors()[0]
        field = {"rank": "r", "alpha": "lora_alpha"}.get(str(first["loc"][0]), first["loc"][0])
        raise AdapterRefused(f"{CONFIG}: {field}: {first['msg']}", hint="a LoRA's config names its rank (r), "
                             "lora_alpha and target_modules, as peft writes them") from None
    problem = safetensors_problem(folder / WEIGHTS)
    if problem:
        raise AdapterRefused(f"the adapter's weights are not whole: {problem}")
    return shape
