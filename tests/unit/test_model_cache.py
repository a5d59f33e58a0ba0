"""Where a base model comes from: a local folder, the node-local cache, the shared cache (copied to
node-local disk once), the site's object store (fetched once per cluster, verified); the hub tier
refuses clearly when the cluster may not download."""

from __future__ import annotations

import pytest

from tests.support.model_folders import write_model_folder
from toolkit.models.cache import COPY_MARK
from toolkit.train.models import ModelFolderBroken, ModelNotFound, resolve_model

ENTRY = "meta-llama--Llama-3.1-8B@abc123"


def test_local_folder_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path), None, str(tmp_path / "shared"), tmp_path / "user-cache") == tmp_path


def test_node_local_cache_comes_before_the_shared_one(tmp_path, monkeypatch):
    local, shared = tmp_path / "local", tmp_path / "shared"
    for cache in (local, shared / "models"):
        write_model_folder(cache / ENTRY)
    monkeypatch.setenv("FT_MODEL_CACHE_LOCAL", str(local))
    assert resolve_model("meta-llama/Llama-3.1-8B", "abc123", str(shared), tmp_path / "user-cache") == local / ENTRY
    (local / ENTRY).rename(tmp_path / "moved-away")
    logged: list[str] = []
    found = resolve_model("meta-llama/Llama-3.1-8B", "abc123", str(shared), tmp_path / "user-cache", log=logged.append)
    assert found == local / ENTRY and (found / COPY_MARK).is_file()  # the shared copy, brought to this node
    assert (found / "model.safetensors").read_bytes() == (shared / "models" / ENTRY / "model.safetensors").read_bytes()
    assert any("copied to node-local disk" in line for line in logged)


def test_a_node_local_copy_ft_made_that_broke_is_made_again(tmp_path, monkeypatch):
    local, shared = tmp_path / "local", tmp_path / "shared"
    write_model_folder(shared / "models" / ENTRY)
    monkeypatch.setenv("FT_MODEL_CACHE_LOCAL", str(local))
    copy = resolve_model("meta-llama/Llama-3.1-8B", "abc123", str(shared), tmp_path / "user-cache", log=print)
    weights = copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes() + b"\0" * 8)  # still parses; not its source's size any more
    logged: list[str] = []
    again = resolve_model("meta-llama/Llama-3.1-8B", "abc123", str(shared), tmp_path / "user-cache",
                          log=logged.append)
    assert again == copy and weights.stat().st_size == (shared / "models" / ENTRY / "model.safetensors").stat().st_size
    assert any("not whole" in line and "fetching it again" in line for line in logged)


@pytest.mark.parametrize("damage", ["no config", "no weights", "truncated weights", "missing shard", "no tokenizer"])
def test_a_cached_model_that_is_not_whole_is_refused_naming_the_folder_and_the_fix(tmp_path, monkeypatch, damage):
    local = tmp_path / "local"
    entry = write_model_folder(local / ENTRY, shards=3 if damage == "missing shard" else 1)
    write_model_folder(tmp_path / "shared" / "models" / ENTRY)  # a whole copy in the next tier is not used
    if damage == "no config":
        (entry / "config.json").unlink()
    elif damage == "no weights":
        (entry / "model.safetensors").unlink()
    elif damage == "truncated weights":
        data = (entry / "model.safetensors").read_bytes()
        (entry / "model.safetensors").write_bytes(data[:-5])
    elif damage == "missing shard":
        (entry / "model-00002-of-00003.safetensors").unlink()
    else:
        (entry / "tokenizer.json").unlink()
    monkeypatch.setenv("FT_MODEL_CACHE_LOCAL", str(local))
    with pytest.raises(ModelFolderBroken) as raised:
        resolve_model("meta-llama/Llama-3.1-8B", "abc123", str(tmp_path / "shared"), tmp_path / "user-cache")
    message = str(raised.value)
    assert f"the cached model {entry} is not whole" in message
    assert {"no config": "config.json is missing", "no weights": "it has no weights",
            "truncated weights": "model.safetensors is truncated",
            "missing shard": "weight shard model-00002-of-00003.safetensors is missing",
            "no tokenizer": "the tokenizer is missing"}[damage] in message
    assert f"delete {entry}" in message


def test_missing_model_names_every_place_looked_and_never_calls_the_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("FT_MODEL_CACHE_LOCAL", str(tmp_path / "local"))
    monkeypatch.delenv("FT_ALLOW_HUB", raising=False)
    with pytest.raises(ModelNotFound) as raised:
        resolve_model("meta-llama/Llama-3.1-70B", None, str(tmp_path / "shared"), tmp_path / "user-cache")
    message = str(raised.value)
    assert "meta-llama/Llama-3.1-70B is not in the cluster's model cache" in message
    assert str(tmp_path / "local" / "meta-llama--Llama-3.1-70B") in message
    assert str(tmp_path / "shared" / "models" / "meta-llama--Llama-3.1-70B") in message
    assert "FT_ALLOW_HUB" in message


def raw_safetensors(header: object) -> bytes:
    import json
    import struct

    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"\0" * 64


HOSTILE = {
    "header is a list": lambda e: (e / "model.safetensors").write_bytes(raw_safetensors([1, 2])),
    "offsets are strings": lambda e: (e / "model.safetensors").write_bytes(
        raw_safetensors({"a": {"dtype": "F32", "shape": [1], "data_offsets": ["0", "4"]}})),
    "offsets run backwards": lambda e: (e / "model.safetensors").write_bytes(
        raw_safetensors({"a": {"dtype": "F32", "shape": [1], "data_offsets": [10, -5]}})),
    "offsets missing": lambda e: (e / "model.safetensors").write_bytes(raw_safetensors({"a": {"dtype": "F32"}})),
    "deeply nested header": lambda e: (e / "model.safetensors").write_bytes(
        __import__("struct").pack("<Q", 200_000) + b"[" * 200_000),
    "weights are a folder": lambda e: ((e / "model.safetensors").unlink(), (e / "model.safetensors").mkdir()),
    "config is a FIFO": lambda e: ((e / "config.json").unlink(), __import__("os").mkfifo(e / "config.json")),
    "config is deeply nested": lambda e: (e / "config.json").write_text("[" * 200_000),
    "empty weight map": lambda e: (e / "model.safetensors.index.json").write_text('{"weight_map": {}}'),
    "shard outside the folder": lambda e: (e / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "../../etc/hostname"}}'),
    "shard name not a string": lambda e: (e / "model.safetensors.index.json").write_text('{"weight_map": {"a": 1}}'),
    "empty tokenizer": lambda e: (e / "tokenizer.json").write_text(""),
    "tokenizer without a model": lambda e: (e / "tokenizer.json").write_text("{}"),
    "symlink loop as config": lambda e: ((e / "config.json").unlink(),
                                         (e / "config.json").symlink_to(e / "config.json")),
}


@pytest.mark.timeout(30)  # a FIFO read would block forever
@pytest.mark.parametrize("damage", sorted(HOSTILE))
def test_hostile_model_folders_are_named_broken_never_crash_or_hang(tmp_path, monkeypatch, damage):
    from toolkit.models.folder import model_folder_problems

    entry = write_model_folder(tmp_path / "local" / ENTRY)
    HOSTILE[damage](entry)
    problems = model_folder_problems(entry)
    assert problems and all(isinstance(problem, str) and problem for problem in problems)
    monkeypatch.setenv("FT_MODEL_CACHE_LOCAL", str(tmp_path / "local"))
    with pytest.raises(ModelFolderBroken, match="is not whole"):
        resolve_model("meta-llama/Llama-3.1-8B", "abc123", str(tmp_path / "shared"), tmp_path / "user-cache")


def test_a_cache_folder_others_may_write_to_is_not_read(tmp_path, monkeypatch):
    local = tmp_path / "local"
    write_model_folder(local / ENTRY)
    local.chmod(0o777)  # anyone could have planted that model
    monkeypatch.setenv("FT_MODEL_CACHE_LOCAL", str(local))
    with pytest.raises(ModelNotFound):
        resolve_model("meta-llama/Llama-3.1-8B", "abc123", str(tmp_path / "shared"), tmp_path / "user-cache")
    local.chmod(0o755)
    found = resolve_model("meta-llama/Llama-3.1-8B", "abc123", str(tmp_path / "shared"), tmp_path / "user-cache")
    assert found == local / ENTRY


def test_a_tokenizer_is_never_taken_from_another_model_with_the_same_prefix(tmp_path, monkeypatch):
    from toolkit.data.tokenizer import TokenizerNotFound, load_length_counter

    local = tmp_path / "local"
    write_model_folder(local / "org--model-evil")
    monkeypatch.setenv("FT_MODEL_CACHE_LOCAL", str(local))
    with pytest.raises(TokenizerNotFound):
        load_length_counter("org/model", str(tmp_path / "shared"))


def test_the_hub_tier_is_the_shared_cache_even_when_the_local_tier_is_left_out(tmp_path, monkeypatch):
    """A distrusted node-local tier is dropped from the tiers read; the hub download must still go
    to the shared tier (not to whatever tier comes second)."""
    import sys
    import types
    from pathlib import Path

    local = tmp_path / "local"
    local.mkdir()
    local.chmod(0o777)
    monkeypatch.setenv("FT_MODEL_CACHE_LOCAL", str(local))
    monkeypatch.setenv("FT_ALLOW_HUB", "1")
    downloads = []

    def snapshot_download(repo_id, revision=None, local_dir=None):  # stand-in: no hub can be reached here
        downloads.append(Path(local_dir).parent)
        write_model_folder(Path(local_dir))

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(snapshot_download=snapshot_download))
    path = resolve_model("org/m", None, str(tmp_path / "shared"), tmp_path / "user-cache")
    assert path == tmp_path / "shared" / "models" / "org--m" and downloads == [tmp_path / "shared" / "models"]


def test_a_revision_with_slashes_is_one_folder_and_one_that_climbs_is_refused(tmp_path, monkeypatch):
    from pydantic import ValidationError

    from toolkit.models.cache import entry_name
    from toolkit.recipe.schema import ModelSpec

    assert entry_name("org/beta", "refs/pr/1") == "org--beta@refs--pr--1"
    assert ModelSpec(base="org/beta", revision="refs/pr/1").revision == "refs/pr/1"
    for climbing in ("x/../../../tmp/escaped", "../up", "/abs", "a//b"):
        with pytest.raises(ValidationError):
            ModelSpec(base="org/beta", revision=climbing)


def test_a_model_with_dot_files_is_copied_to_node_local_disk(tmp_path, monkeypatch):
    local, shared = tmp_path / "local", tmp_path / "shared"
    entry = write_model_folder(shared / "models" / ENTRY)
    (entry / ".gitattributes").write_text("*.safetensors filter=lfs\n")  # what a hub download leaves
    (entry / ".cache" / "huggingface").mkdir(parents=True)
    (entry / ".cache" / "huggingface" / "download.lock").write_text("x" * 100)
    monkeypatch.setenv("FT_MODEL_CACHE_LOCAL", str(local))
    logged: list[str] = []
    found = resolve_model("meta-llama/Llama-3.1-8B", "abc123", str(shared), tmp_path / "user-cache",
                          log=logged.append)
    assert found == local / ENTRY, logged
    assert not any("not whole" in line for line in logged)
