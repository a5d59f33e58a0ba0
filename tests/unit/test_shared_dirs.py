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

from toolkit.shared_dirs import SharedFolderError, common_dir, private_dir, trusted_owner_dir, user_cache

OTHER_UID = 4242  # no such account: what `ls` shows for a departed user, and as good as a live one here

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="plays another user with chown, which needs root")


def made_by_another_user(path: Path, mode: int = 0o755) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(mode)
    os.chown(path, OTHER_UID, OTHER_UID)
    return path


def test_common_folders_are_sticky_and_world_writable_whatever_the_umask(tmp_path):
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
    assert f"{squatted} belongs to uid {OTHER_UID}, not to you" in str(raised.value)
    assert "ask the cluster's admins to remove" in str(raised.value)


def test_a_private_folder_others_may_write_or_a_symlink_in_its_place_is_refused(tmp_path):
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(SharedFolderError, match="may be written by other users"):
        private_dir(open_to_all)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(SharedFolderError, match="is not a folder"):
        private_dir(tmp_path / "link")


def test_the_user_cache_is_private_inside_a_common_cache_folder(tmp_path):
    folder = user_cache(str(tmp_path))
    assert folder == tmp_path / "cache" / f"uid-{os.getuid()}"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o1777


@needs_root
def test_model_tiers_are_read_only_from_trusted_owners(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    mine = tmp_path / "mine"
    mine.mkdir()
    assert trusted_owner_dir(mine, str(shared))
    assert not trusted_owner_dir(made_by_another_user(tmp_path / "theirs"), str(shared))
    world = tmp_path / "world"
    world.mkdir()
    world.chmod(0o777)
    assert not trusted_owner_dir(world, str(shared))
    # The shared root's owner (a site's service account) is trusted with the tiers under it.
    os.chown(shared, OTHER_UID, OTHER_UID)
    assert trusted_owner_dir(made_by_another_user(shared / "models"), str(shared))


@needs_root
def test_a_node_local_model_tier_planted_by_another_user_is_not_read(tmp_path, monkeypatch):
    from tests.support.model_folders import write_model_folder
    from toolkit.model_cache import cache_dirs
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
    key = recipe_data.dataset_key(resolved.recipe, str(data), counter, "train")
    squatted = made_by_another_user(tmp_path / "shared" / "cache" / f"uid-{os.getuid()}", mode=0o777)
    planted = squatted / "tokenized" / key
    planted.mkdir(parents=True)
    (planted / "meta.json").write_text(json.dumps({"key": key, "report": {"path": str(data), "rows": 40}}))

    (report,) = recipe_data.validate_recipe_data(resolved)

    assert "too_few_rows" in report.errors  # 40 rows: the fresh pass found what the planted report hid
    assert "token_cache_unusable" in report.warnings


@needs_root
def test_a_worker_whose_user_cache_was_made_by_another_user_caches_in_its_run_folder(tmp_path, capsys):
    from toolkit.train.worker import cache_root

    made_by_another_user(tmp_path / "shared" / "cache" / f"uid-{os.getuid()}")
    run_dir = private_dir(tmp_path / "run")
    assert cache_root(str(tmp_path / "shared"), run_dir) == run_dir / "cache"
    assert "belongs to uid 4242, not to you" in capsys.readouterr().out
    assert cache_root(str(tmp_path / "elsewhere"), run_dir) == tmp_path / "elsewhere" / "cache" / f"uid-{os.getuid()}"
