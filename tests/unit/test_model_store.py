"""The object store's model tier, against a real S3 server (SeaweedFS on loopback): a model pushed
with `ft model push` is fetched once per cluster however many nodes ask at once (real processes,
real locks), copied once per node, verified against its manifest; a corrupt object is refused and
leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.support.model_folders import write_model_folder
from tests.support.s3 import filesystem, s3_server
from toolkit.model_cache import DOWNLOAD_MARK, ModelFolderBroken, find_model

pytest.importorskip("s3fs")
BUCKET = "models"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        fs = filesystem(server.env)
        fs.mkdir(BUCKET)
        yield server, fs


@pytest.fixture
def s3_env(store, monkeypatch) -> dict[str, str]:
    from toolkit.data import object_store

    server, _ = store
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    object_store.configure()
    return server.env


def push(tmp_path: Path, env: dict[str, str], folder: Path, name: str) -> subprocess.CompletedProcess:
    """`ft model push`, as an admin runs it, to a profile that names the test store's bucket."""
    clusters = tmp_path / "clusters.yaml"
    clusters.write_text(yaml.safe_dump({"site": {"extends": "lab", "s3_models": f"s3://{BUCKET}"}}))
    return subprocess.run([sys.executable, "-m", "toolkit", "model", "push", str(folder), "--name", name,
                           "--cluster", "site"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env, "FT_CLUSTERS_FILE": str(clusters)})


def test_a_pushed_model_is_fetched_once_however_many_nodes_ask_at_once(tmp_path, s3_env):
    source = write_model_folder(tmp_path / "source", shards=3)
    pushed = push(tmp_path, s3_env, source, "org/shared-model@v1")
    assert pushed.returncode == 0, pushed.stderr
    assert f"s3://{BUCKET}/org--shared-model@v1" in pushed.stdout and "model.base: org/shared-model" in pushed.stdout
    shared_root = tmp_path / "shared-root"
    # Four "nodes" at once, each with its own node-local disk, one shared filesystem between them.
    node = textwrap.dedent(f"""
        import sys
        from toolkit.data import object_store
        from toolkit.model_cache import find_model
        object_store.configure()
        path, _ = find_model("org--shared-model@v1", {str(shared_root)!r}, "s3://{BUCKET}", print)
        print("PATH", path)
    """)
    nodes = [subprocess.Popen([sys.executable, "-c", node], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, **s3_env, "FT_MODEL_CACHE_LOCAL": str(tmp_path / f"node{i}")})
             for i in range(4)]
    outputs = [process.communicate(timeout=120)[0] for process in nodes]
    assert all(process.returncode == 0 for process in nodes), outputs
    assert sum(output.count("fetched from s3://") for output in outputs) == 1, outputs  # once per cluster
    assert all(output.count("copied to node-local disk") == 1 for output in outputs), outputs  # once per node
    for index, output in enumerate(outputs):
        assert f"PATH {tmp_path / f'node{index}' / 'org--shared-model@v1'}" in output
    entry = shared_root / "models" / "org--shared-model@v1"
    assert json.loads((entry / DOWNLOAD_MARK).read_text())["files"].keys() >= {"config.json", "tokenizer.json"}
    assert not [p for p in entry.parent.iterdir() if p.name.startswith((".download", ".discarded"))]


def test_a_corrupt_object_is_refused_and_leaves_nothing_in_the_cache(tmp_path, s3_env, store):
    _, fs = store
    source = write_model_folder(tmp_path / "source")
    assert push(tmp_path, s3_env, source, "org/corrupt").returncode == 0
    key = f"{BUCKET}/org--corrupt/model.safetensors"
    data = bytearray(fs.cat_file(key))
    data[-1] ^= 0xFF
    fs.pipe_file(key, bytes(data))
    os.environ["FT_MODEL_CACHE_LOCAL"] = str(tmp_path / "local")
    try:
        with pytest.raises(ModelFolderBroken, match="model.safetensors does not match its sha256"):
            find_model("org--corrupt", str(tmp_path / "shared-root"), f"s3://{BUCKET}", print)
    finally:
        del os.environ["FT_MODEL_CACHE_LOCAL"]
    models = tmp_path / "shared-root" / "models"
    assert not (models / "org--corrupt").exists()
    assert not [p for p in models.iterdir() if not p.name.endswith(".lock")]


def test_a_model_the_store_does_not_have_is_not_found_and_push_refuses_a_broken_folder(tmp_path, s3_env,
                                                                                      monkeypatch):
    monkeypatch.setenv("FT_MODEL_CACHE_LOCAL", str(tmp_path / "local"))
    path, looked = find_model("org--absent", str(tmp_path / "shared-root"), f"s3://{BUCKET}", print)
    assert path is None and looked[-1] == f"s3://{BUCKET}/org--absent"
    broken = write_model_folder(tmp_path / "broken")
    (broken / "tokenizer.json").unlink()
    refused = push(tmp_path, s3_env, broken, "org/broken")
    assert refused.returncode != 0 and "is not a whole model folder" in refused.stderr
    assert "the tokenizer is missing" in refused.stderr


def test_validation_gets_the_tokenizer_alone_from_the_store_verified(tmp_path, s3_env, store):
    from toolkit.model_cache import fetch_tokenizer

    _, fs = store
    source = write_model_folder(tmp_path / "source")
    assert push(tmp_path, s3_env, source, "org/tok").returncode == 0
    cache = tmp_path / "user-cache"
    folder = fetch_tokenizer("org--tok", f"s3://{BUCKET}", cache)
    assert folder == cache / "tokenizers" / "org--tok"
    assert (folder / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert not (folder / "model.safetensors").exists()  # the weights stay in the store
    fs.pipe_file(f"{BUCKET}/org--tok/tokenizer.json", b'{"model": {"type": "planted"}}')  # changed after push
    assert fetch_tokenizer("org--tok", f"s3://{BUCKET}", tmp_path / "other-cache") is None
    assert fetch_tokenizer("org--absent", f"s3://{BUCKET}", tmp_path / "other-cache") is None
