"""DeepSpeed's compiled op cache (the CPU accelerator's shared-memory collective, a real build with
torch's JIT): a dead build's lock file never blocks, a truncated library is rebuilt, never loaded
(loading one kills the process with SIGBUS)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="the training stack (ft[train]) is not installed")

PREPARE = ("import sys\n"
           "from pathlib import Path\n"
           "from toolkit.train import compiled_ops\n"
           "root = compiled_ops.prepare(Path(sys.argv[1]), lambda m: print('WARN', m, flush=True))\n"
           "print('ROOT', root)\n")


def prepare(user_cache: Path) -> subprocess.CompletedProcess:
    env = {name: value for name, value in os.environ.items() if name != "TORCH_EXTENSIONS_DIR"}
    env |= {"DS_ACCELERATOR": "cpu", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    # A hang (torch waiting on a dead build's lock) fails the test instead of stalling the suite.
    return subprocess.run([sys.executable, "-c", PREPARE, str(user_cache)], capture_output=True, text=True,
                          timeout=300, env=env)


def seed_from_a_verified_build(shared: Path) -> None:
    """The first build, copied from this user's lab cache when a lab run already built and
    verified the op there (the suite's lab tests do): one real build (~50 s) instead of two. The
    build under test is the second one, after the damage."""
    from toolkit.train import compiled_ops

    lab_cache = Path(os.environ.get("FT_LAB_STATE_DIR", "/var/lib/ft-lab")) / "shared" / "cache" / f"uid-{os.getuid()}"
    try:
        built = compiled_ops.extensions_dir(lab_cache)
    except ImportError:
        return
    folders = [built / builder.name for builder in compiled_ops.jit_builders()]
    if folders and all(compiled_ops.verified(folder) for folder in folders):
        shutil.copytree(built, compiled_ops.extensions_dir(shared))


def test_a_dead_builds_lock_does_not_block_the_next_build(tmp_path):
    shared = tmp_path / "uid-0"
    seed_from_a_verified_build(shared)
    first = prepare(shared)
    assert first.returncode == 0, first.stderr[-3000:]
    root = Path(first.stdout.split("ROOT ", 1)[1].strip())
    assert root.parent == shared / "torch_extensions" and "-torch" in root.name and "-ds" in root.name
    library = next(root.glob("deepspeed_shm_comm/*.so"))
    (library.parent / "lock").touch()  # what a build killed mid-way leaves
    library.write_bytes(library.read_bytes()[:4096])  # ...and its library, cut short while linking

    second = prepare(shared)

    assert second.returncode == 0, second.stderr[-3000:]
    assert "removing" in second.stdout and "left by a build that did not finish" in second.stdout
    assert "is not the one ft saw load" in second.stdout and "rebuilding it" in second.stdout
    assert library.stat().st_size > 4096 and not (library.parent / "lock").exists()
    third = prepare(shared)  # the rebuilt op is trusted as is
    assert third.returncode == 0 and "WARN" not in third.stdout, third.stdout + third.stderr[-2000:]


def test_compiled_layers_share_one_cache_per_user_and_stack(tmp_path, monkeypatch):
    from toolkit.train import compiled_ops

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "")  # monkeypatch restores what was there before
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    folder = compiled_ops.share_inductor_cache(tmp_path)
    assert folder.parent == tmp_path / "torchinductor"
    assert folder.name == compiled_ops.extensions_dir(tmp_path).name  # per Python, torch and DeepSpeed
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")  # the user's choice wins
    assert compiled_ops.share_inductor_cache(tmp_path) == Path("/elsewhere")
