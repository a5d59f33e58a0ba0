"""DeepSpeed's just-in-time compiled ops, cached on the shared filesystem: one build per user and
software stack, trusted only when it loads.

On the lab's CPU accelerator that is the shared-memory collective (about 40 s to compile). torch
guards a build folder with a `lock` file that a killed build leaves behind, and every later build
then waits on it forever; a build killed while linking leaves a truncated library, and loading
one kills the process (SIGBUS), every time. So ft builds under its own lock (a flock: the kernel
releases it when its holder dies), removes a `lock` left by a dead build, and records the SHA-256
of each library once it has loaded; a library that does not match its record is rebuilt, never
loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from toolkit.base.cache_entries import discard, exclusive

TORCH_BATON = "lock"  # torch.utils.cpp_extension's FileBaton in each build folder
VERIFIED = ".ft-verified"  # {library: sha256} of the libraries seen to load


def extensions_dir(user_cache: Path) -> Path:
    """In the user's own cache (a library there is loaded into the user's jobs: no other user may
    put one there), per Python, torch and DeepSpeed version (a build from another stack is never
    picked up)."""
    import deepspeed
    import torch

    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}-ds{deepspeed.__version__}"
    return user_cache / "torch_extensions" / tag.replace("+", "_")


def share_inductor_cache(user_cache: Path) -> Path:
    """torch.compile's kernels and graphs (regional compilation, models.py) cached beside the
    DeepSpeed ops: a requeued or restarted rank on any node reuses them instead of compiling again
    (15-20 s on an 8B model at each start: GPU.md). Inductor writes its entries whole (a temporary
    file renamed), so ranks share the folder. TORCHINDUCTOR_CACHE_DIR set by the user wins."""
    per_stack = user_cache / "torchinductor" / extensions_dir(user_cache).name
    return Path(os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(per_stack)))


def jit_builders() -> list:
    """The ops this accelerator compiles on first use that ft's runtime needs (DeepSpeed's own rule
    in deepspeed.comm.torch.build_shm_op); ft's optimizer is torch's AdamW, which needs none."""
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return []
    return [builder]


def prepare(user_cache: Path, warn: Callable[[str], None]) -> Path:
    """Point torch at ft's extension cache and make sure each op there loads, building or rebuilding
    it under ft's lock. TORCH_EXTENSIONS_DIR set by the user wins."""
    root = Path(os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir(user_cache))))
    builders = jit_builders()
    if not builders:
        return root
    with exclusive(root / ".ft-build.lock"):
        for builder in builders:
            load_or_rebuild(builder, root / builder.name, warn)
    return root


def load_or_rebuild(builder, folder: Path, warn: Callable[[str], None]) -> None:
    baton = folder / TORCH_BATON
    if baton.exists():  # every ft build holds the flock: a baton seen under it is a dead build's
        warn(f"removing {baton}, left by a build that did not finish (torch would wait on it forever)")
        baton.unlink(missing_ok=True)
    if folder.exists() and not verified(folder):
        warn(f"the compiled op in {folder} is not the one ft saw load (a build cut short, or changed "
             "since): rebuilding it")
        discard(folder)
    builder.load(verbose=False)
    # An op installed with DeepSpeed (DS_BUILD_OPS) loads without a build folder: nothing to record.
    if folder.is_dir() and not verified(folder):
        (folder / VERIFIED).write_text(json.dumps(libraries(folder)) + "\n")


def libraries(folder: Path) -> dict[str, str]:
    return {library.name: hashlib.sha256(library.read_bytes()).hexdigest() for library in sorted(folder.glob("*.so"))}


def verified(folder: Path) -> bool:
    try:
        recorded = json.loads((folder / VERIFIED).read_text())
    except (OSError, ValueError):
        return False
    return bool(recorded) and recorded == libraries(folder)
