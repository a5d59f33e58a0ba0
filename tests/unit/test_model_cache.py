"""Where a base model comes from: a local folder, the node-local cache, the shared cache; the hub
tier refuses clearly when the cluster may not download."""

from __future__ import annotations

import pytest

from toolkit.train.models import ModelNotFound, resolve_model


def test_local_folder_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path), None, str(tmp_path / "shared")) == tmp_path


def test_node_local_cache_comes_before_the_shared_one(tmp_path, monkeypatch):
    local, shared = tmp_path / "local", tmp_path / "shared"
    for cache in (local, shared / "models"):
        (cache / "meta-llama--Llama-3.1-8B@abc123").mkdir(parents=True)
        (cache / "meta-llama--Llama-3.1-8B@abc123" / "config.json").write_text("{}")
    monkeypatch.setenv("FT_MODEL_CACHE_LOCAL", str(local))
    assert resolve_model("meta-llama/Llama-3.1-8B", "abc123", str(shared)) == local / "meta-llama--Llama-3.1-8B@abc123"
    (local / "meta-llama--Llama-3.1-8B@abc123" / "config.json").unlink()
    assert resolve_model("meta-llama/Llama-3.1-8B", "abc123", str(shared)).parent == shared / "models"


def test_missing_model_names_every_place_looked_and_never_calls_the_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("FT_MODEL_CACHE_LOCAL", str(tmp_path / "local"))
    monkeypatch.delenv("FT_ALLOW_HUB", raising=False)
    with pytest.raises(ModelNotFound) as raised:
        resolve_model("meta-llama/Llama-3.1-70B", None, str(tmp_path / "shared"))
    message = str(raised.value)
    assert "meta-llama/Llama-3.1-70B is not in the cluster's model cache" in message
    assert str(tmp_path / "local" / "meta-llama--Llama-3.1-70B") in message
    assert str(tmp_path / "shared" / "models" / "meta-llama--Llama-3.1-70B") in message
    assert "FT_ALLOW_HUB" in message
