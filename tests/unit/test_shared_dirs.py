"""Folders on the shared filesystem between users: common ones (sticky, world-writable) and private
ones, which ft never uses when another user made them first. Another user is played by chown to an
unused uid (these tests need root, as the lab does); the lab test with two real accounts is
tests/lab/test_multi_user.py."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import yaml

from toolkit.base.shared_dirs import SharedFolderError, common_dir, private_dir, trusted_owner_dir, user_cache
from toolkit.storage.object_store import ObjectStore

OTHER_UID = 4242  # no such account: what `ls` shows for a departed user, and as good as a live one here

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="plays another user with chown, which needs root")


def made_by_another_user(path: Path, mode: int = 0o755) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(mode)
    os.chown(path, OTHER_UID, OTHER_UID)
    return path


def test_common_folders_are_sticky_and_world_writable_whatever_the_umask(tmp_path):
    (tmp_path / "shared").mkdir()
    previous = os.umask(0o077)
    try:
        folder = common_dir(tmp_path / "shared" / "runs")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o1777


def test_private_folders_are_made_0700_and_reused_when_the_users_own(tmp_path):
    previous = os.umask(0)
    try:
        folder = private_dir(tmp_path / "mine")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert private_dir(folder) == folder


@needs_root
def test_a_private_folder_another_user_made_first_is_refused_naming_them(tmp_path):
    squatted = made_by_another_user(tmp_path / "cache" / f"uid-{os.getuid()}")
    with pytest.raises(SharedFolderError) as raised:
        private_dir(squatted)
    assert f"{squatted} is a folder of uid {OTHER_UID}, not yours" in str(raised.value)
    assert "ask the cluster's admins to remove" in str(raised.value)


@needs_root
@pytest.mark.parametrize("made", ["by another user", "as a symlink", "open and not sticky"])
def test_a_common_folder_anyone_could_rename_entries_in_is_not_used_and_blocks_no_one(tmp_path, made, capsys):
    """The owner of a folder may rename anything in it, sticky or not: swap a user's private
    folder for a symlink to their own, after ft checked it. So it is not used; and since such a
    folder (made by the first user of ft on a site whose admins made none, or taken to block
    everyone) would otherwise turn the cache off for every other user, each uses a private folder
    of their own beside it, said once."""
    shared = tmp_path / "shared"
    shared.mkdir()
    cache = shared / "cache"
    if made == "by another user":
        made_by_another_user(cache, mode=0o1777)
    elif made == "as a symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o1777)
        cache.symlink_to(tmp_path / "elsewhere")
    else:
        cache.mkdir()
        cache.chmod(0o777)
    from toolkit.base import shared_dirs

    shared_dirs._said.clear()
    folder = user_cache(str(shared))
    assert folder == shared / f".cache-uid-{os.getuid()}" and stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert not (cache / f"uid-{os.getuid()}").exists()
    said = " ".join(capsys.readouterr().err.split())
    assert f"using {folder} instead" in said and f"mkdir -m 1777 {cache}" in said
    assert user_cache(str(shared)) == folder and capsys.readouterr().err == ""  # said once
    os.rmdir(folder)
    made_by_another_user(folder, mode=0o700)  # the fallback taken too: this one user is refused, by name
    with pytest.raises(SharedFolderError, match="ask the cluster's admins to remove"):
        user_cache(str(shared))


@needs_root
def test_a_shared_root_of_another_user_is_not_built_on_and_a_missing_one_not_made(tmp_path):
    with pytest.raises(SharedFolderError, match="does not exist"):
        user_cache(str(tmp_path / "missing"))
    assert not (tmp_path / "missing").exists()
    theirs = made_by_another_user(tmp_path / "theirs", mode=0o1777)
    with pytest.raises(SharedFolderError, match=f"belongs to uid {OTHER_UID}"):
        user_cache(str(theirs))


def test_without_a_shared_root_the_cache_is_private_in_the_home_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    folder = user_cache("")
    assert folder == tmp_path / "ft" / "cache"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700 and stat.S_IMODE(folder.parent.stat().st_mode) == 0o700


def test_a_private_folder_others_may_write_or_a_symlink_in_its_place_is_refused(tmp_path):
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(SharedFolderError, match="may be written by other users"):
        private_dir(open_to_all)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SharedFolderError, match="is a symlink of"):
        private_dir(tmp_path / "link")


def test_the_user_cache_is_private_inside_a_common_cache_folder(tmp_path):
    previous = os.umask(0o077)
    try:
        folder = user_cache(str(tmp_path))
    finally:
        os.umask(previous)
    assert folder == tmp_path / "cache" / f"uid-{os.getuid()}"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o1777


@needs_root
def test_model_tiers_are_read_only_from_trusted_owners(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    assert trusted_owner_dir(mine) and trusted_owner_dir(tmp_path / "not-there-yet")
    assert not trusted_owner_dir(made_by_another_user(tmp_path / "theirs"))
    world = tmp_path / "world"
    world.mkdir()
    world.chmod(0o777)
    assert not trusted_owner_dir(world)
    (tmp_path / "link").symlink_to(mine)  # even to a trusted folder: whoever placed the link chose where
    assert not trusted_owner_dir(tmp_path / "link")


@needs_root
def test_a_node_local_model_tier_planted_by_another_user_is_not_read(tmp_path, monkeypatch):
    from tests.support.model_folders import write_model_folder
    from toolkit.models.cache import cache_dirs
    from toolkit.train.models import ModelNotFound, resolve_model

    local = made_by_another_user(tmp_path / f"ft-model-cache-{os.getuid()}")
    write_model_folder(local / "org--planted")
    monkeypatch.setenv("FT_MODEL_CACHE_LOCAL", str(local))
    monkeypatch.delenv("FT_ALLOW_HUB", raising=False)
    assert local not in cache_dirs(str(tmp_path / "shared"))
    with pytest.raises(ModelNotFound):
        resolve_model("org/planted", None, str(tmp_path / "shared"), tmp_path / "user-cache")


@needs_root
def test_the_hub_never_downloads_into_another_users_model_tier(tmp_path, monkeypatch):
    from toolkit.train.models import ModelNotFound, resolve_model

    made_by_another_user(tmp_path / "shared" / "models")
    monkeypatch.setenv("FT_ALLOW_HUB", "1")
    monkeypatch.setenv("FT_MODEL_CACHE_LOCAL", str(tmp_path / "local"))
    with pytest.raises(ModelNotFound, match="belongs to another user: ft neither reads nor downloads into it"):
        resolve_model("org/m", None, str(tmp_path / "shared"), tmp_path / "user-cache")


@needs_root
def test_validation_ignores_a_token_cache_another_user_made_and_says_so(tmp_path, monkeypatch):
    """A planted report that calls bad data clean is never read: the data is validated afresh."""
    from toolkit.data import recipe_data
    from toolkit.recipe.resolve import resolve

    (tmp_path / "clusters.yaml").write_text(yaml.safe_dump(
        {"mine": {"extends": "lab", "shared_root": str(tmp_path / "shared")}}))
    monkeypatch.setenv("FT_CLUSTERS_FILE", str(tmp_path / "clusters.yaml"))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}", "completion": f"a{i}"}) + "\n" for i in range(40)))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "model": {"base": "tiny-llama"}, "data": {"train": str(data)},
                                      "resources": {"nodes": 1, "gpus_per_node": 1}}))
    resolved = resolve(recipe, "mine")
    counter, _ = recipe_data.tokenizer_for(resolved)
    key = recipe_data.dataset_key(resolved.recipe, str(data), counter, "train", ObjectStore())
    squatted = made_by_another_user(tmp_path / "shared" / "cache" / f"uid-{os.getuid()}", mode=0o777)
    planted = squatted / "tokenized" / key
    planted.mkdir(parents=True)
    (planted / "meta.json").write_text(json.dumps({"key": key, "report": {"path": str(data), "rows": 40}}))

    (report,) = recipe_data.validate_recipe_data(resolved)

    assert "too_few_rows" in report.errors  # 40 rows: the fresh pass found what the planted report hid
    assert "token_cache_unusable" in report.warnings


@needs_root
def test_a_worker_whose_user_cache_was_made_by_another_user_caches_in_its_run_folder(tmp_path, capsys):
    from toolkit.train.dataset import cache_root

    made_by_another_user(tmp_path / "shared" / "cache" / f"uid-{os.getuid()}")
    run_dir = private_dir(tmp_path / "run")
    warnings = []
    assert cache_root(str(tmp_path / "shared"), run_dir, warnings.append) == run_dir / "cache"
    assert "is a folder of uid 4242, not yours" in warnings[0]
    (tmp_path / "elsewhere").mkdir()
    assert cache_root(str(tmp_path / "elsewhere"), run_dir, warnings.append) == \
        tmp_path / "elsewhere" / "cache" / f"uid-{os.getuid()}"


@needs_root
def test_run_folders_of_other_users_in_a_common_runs_root_are_neither_listed_nor_loaded(tmp_path):
    from toolkit.runs.store import RunNotFound, RunStore

    (tmp_path / "shared").mkdir()
    store = RunStore(tmp_path / "shared" / "runs", common=True)
    mine = store.claim_run_dir("mine")
    (store.root / mine / "run.json").write_text(json.dumps({
        "run_id": mine, "recipe_name": "mine", "recipe_path": "r.yaml", "cluster": "lab", "mode": "train",
        "created": 1.0}))
    planted = made_by_another_user(store.root / "planted-run", mode=0o755)
    (planted / "run.json").write_text(json.dumps({
        "run_id": "planted-run", "recipe_name": "x", "recipe_path": "x", "cluster": "lab", "mode": "train",
        "created": 9e9, "jobs": [{"job_id": "1", "submitted": 1.0}]}))
    fifo_run = store.root / "fifo-run"
    fifo_run.mkdir()
    os.mkfifo(fifo_run / "run.json")  # would block a plain read forever
    (store.root / "zero-run").mkdir()
    (store.root / "zero-run" / "run.json").symlink_to("/dev/zero")

    assert [record.run_id for record in store.list()] == [mine]
    for other in ("planted-run", "fifo-run", "zero-run"):
        with pytest.raises(RunNotFound):
            store.load(other)


def test_a_run_id_someone_else_took_is_skipped_and_a_flood_is_a_clear_error(tmp_path, monkeypatch):
    from toolkit.base.errors import FtError
    from toolkit.runs import store as run_store

    store = run_store.RunStore(tmp_path / "runs")
    (tmp_path / "runs" / "r-1").mkdir(parents=True)
    ids = iter(["r-1", "r-2"])
    monkeypatch.setattr(run_store, "new_run_id", lambda name: next(ids))
    assert store.claim_run_dir("r") == "r-2"
    monkeypatch.setattr(run_store, "new_run_id", lambda name: "r-1")
    with pytest.raises(FtError, match="were all taken"):
        store.claim_run_dir("r")


def test_an_output_that_is_no_plain_file_is_written_to_never_replaced(tmp_path):
    """`ft render -o` / `ft report -o` as root: a rename over /dev/null would leave a file there. A
    FIFO stands in for the device here (the same rule: exists, and is not a regular file)."""
    import threading

    from toolkit.base.shared_dirs import write_output

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()))
    reader.start()
    write_output(fifo, "page\n")
    reader.join(timeout=10)
    assert received == ["page\n"] and stat.S_ISFIFO(fifo.lstat().st_mode)
    real = tmp_path / "real.html"
    real.write_text("old")
    link = tmp_path / "link.html"
    link.symlink_to(real)
    write_output(link, "new", mode=0o644)
    assert link.is_symlink() and real.read_text() == "new" and real.stat().st_mode & 0o777 == 0o644
