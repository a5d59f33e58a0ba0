"""The object store's model tier, against a real S3 server (SeaweedFS on loopback): a model pushed
with `ft model push` is fetched once per cluster however many nodes ask at once (real processes,
real locks), copied once per node, verified against its manifest, and the manifest against the
pusher's record on the shared filesystem; a corrupt object, or a model replaced in the bucket by
whoever can write it, is refused and leaves nothing behind."""

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
from toolkit.models.cache import DOWNLOAD_MARK, ModelFolderBroken, find_model
from toolkit.storage.object_store import ObjectStore

STORE = ObjectStore()  # the store the environment names: the test server's (s3_env)

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
    server, _ = store
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)  # the store the environment names, as a job's script exports it
    return server.env


def shared_root(tmp_path: Path) -> str:
    """The test's shared filesystem: where the model cache and the pushers' records are."""
    (tmp_path / "shared-root").mkdir(exist_ok=True)
    return str(tmp_path / "shared-root")


def push(tmp_path: Path, env: dict[str, str], folder: Path, name: str) -> subprocess.CompletedProcess:
    """`ft model push`, as an admin runs it, to a profile that names the test store's bucket."""
    clusters = tmp_path / "clusters.yaml"
    clusters.write_text(yaml.safe_dump({"site": {"extends": "lab", "s3_models": f"s3://{BUCKET}",
                                                 "shared_root": shared_root(tmp_path)}}))
    return subprocess.run([sys.executable, "-m", "toolkit", "model", "push", str(folder), "--name", name,
                           "--cluster", "site"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env, "FT_CLUSTERS_FILE": str(clusters)})


def test_a_pushed_model_is_fetched_once_however_many_nodes_ask_at_once(tmp_path, s3_env):
    source = write_model_folder(tmp_path / "source", shards=3)
    pushed = push(tmp_path, s3_env, source, "org/shared-model@v1")
    assert pushed.returncode == 0, pushed.stderr
    assert f"s3://{BUCKET}/org--shared-model@v1" in pushed.stdout and "model.base: org/shared-model" in pushed.stdout
    shared_root = Path(globals()["shared_root"](tmp_path))
    # Four "nodes" at once, each with its own node-local disk, one shared filesystem between them.
    node = textwrap.dedent(f"""
        import sys
        from toolkit.models.cache import find_model
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


def test_a_model_push_whose_upload_fails_unforeseen_is_refused_and_records_nothing(tmp_path, monkeypatch):
    """cli/model.py's blind except: the upload failing in a way nobody foresaw (neither an OSError nor
    botocore's ClientError) is refused naming where it was going, and no record names a manifest the
    store may not hold (narrowed to OSError, this test fails: checked)."""
    from toolkit.base.errors import FtError
    from toolkit.checkpoint import remote
    from toolkit.cli.model import push as model_push
    from toolkit.models import records as model_records

    class Unforeseen(Exception):
        pass

    def upload(*args, **kwargs):
        raise Unforeseen("the store answered in a way nobody foresaw")

    clusters = tmp_path / "clusters.yaml"
    clusters.write_text(yaml.safe_dump({"site": {"extends": "lab", "s3_models": f"s3://{BUCKET}",
                                                 "shared_root": shared_root(tmp_path)}}))
    monkeypatch.setenv("FT_CLUSTERS_FILE", str(clusters))
    monkeypatch.setattr(remote, "put_folder", upload)
    with pytest.raises(FtError, match=rf"uploading to s3://{BUCKET}/org--unforeseen failed: Unforeseen: the store"):
        model_push(write_model_folder(tmp_path / "source"), "org/unforeseen", "site")
    assert not model_records.record_path(shared_root(tmp_path), "org--unforeseen").exists()
    assert model_records.check(shared_root(tmp_path), "org--unforeseen", b"{}")  # no record: jobs take nothing


def test_validation_gets_the_tokenizer_alone_from_the_store_verified(tmp_path, s3_env, store):
    from toolkit.models.cache import fetch_tokenizer

    _, fs = store
    source = write_model_folder(tmp_path / "source")
    assert push(tmp_path, s3_env, source, "org/tok").returncode == 0
    cache = tmp_path / "user-cache"
    folder = fetch_tokenizer("org--tok", f"s3://{BUCKET}", cache, shared_root(tmp_path), STORE)
    assert folder == cache / "tokenizers" / "org--tok"
    assert (folder / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert not (folder / "model.safetensors").exists()  # the weights stay in the store
    fs.pipe_file(f"{BUCKET}/org--tok/tokenizer.json", b'{"model": {"type": "planted"}}')  # changed after push
    assert fetch_tokenizer("org--tok", f"s3://{BUCKET}", tmp_path / "other-cache", shared_root(tmp_path), STORE) is None
    other = tmp_path / "other-cache"
    assert fetch_tokenizer("org--absent", f"s3://{BUCKET}", other, shared_root(tmp_path), STORE) is None


def replace_in_bucket(fs, name: str, folder: Path) -> None:
    """What anyone who can write the bucket (a site's one shared role) can do: a whole, self-consistent
    model of their own under another's name, its manifest naming its own files."""
    from toolkit.checkpoint import manifest
    from toolkit.checkpoint.remote import put_folder

    put_folder(fs, folder, manifest.describe(folder, 0, ""), f"{BUCKET}/{name}")


def test_a_model_replaced_in_the_bucket_after_its_push_is_refused_by_jobs_and_validation(tmp_path, s3_env, store,
                                                                                      monkeypatch):
    from toolkit.models.cache import fetch_tokenizer

    _, fs = store
    assert push(tmp_path, s3_env, write_model_folder(tmp_path / "source"), "org/victim").returncode == 0
    planted = write_model_folder(tmp_path / "planted")
    (planted / "tokenizer.json").write_text('{"model": {"type": "planted"}}')
    replace_in_bucket(fs, "org--victim", planted)
    monkeypatch.setenv("FT_MODEL_CACHE_LOCAL", str(tmp_path / "local"))
    with pytest.raises(ModelFolderBroken, match="is not the one user root .* pushed"):
        find_model("org--victim", shared_root(tmp_path), f"s3://{BUCKET}", print)
    assert not (Path(shared_root(tmp_path)) / "models" / "org--victim").exists()
    assert fetch_tokenizer("org--victim", f"s3://{BUCKET}", tmp_path / "cache", shared_root(tmp_path), STORE) is None
    # Pushed again by its owner: taken again.
    assert push(tmp_path, s3_env, write_model_folder(tmp_path / "source"), "org/victim").returncode == 0
    path, _ = find_model("org--victim", shared_root(tmp_path), f"s3://{BUCKET}", print)
    assert path is not None and (path / "tokenizer.json").read_text() != '{"model": {"type": "planted"}}'


def test_a_model_in_the_bucket_that_nobody_pushed_through_ft_is_refused_naming_the_fix(tmp_path, s3_env, store,
                                                                                     monkeypatch):
    _, fs = store
    replace_in_bucket(fs, "org--unrecorded", write_model_folder(tmp_path / "planted"))
    monkeypatch.setenv("FT_MODEL_CACHE_LOCAL", str(tmp_path / "local"))
    with pytest.raises(ModelFolderBroken, match="nobody pushed it through ft here .*`ft model push`"):
        find_model("org--unrecorded", shared_root(tmp_path), f"s3://{BUCKET}", print)


def test_a_record_folder_another_user_owns_is_not_trusted(tmp_path):
    from toolkit.models import records as model_records

    records = Path(shared_root(tmp_path)) / model_records.RECORDS
    records.mkdir(mode=0o777)
    os.chmod(records, 0o777)
    if os.getuid() == 0:
        os.chown(records, 65534, 65534)
    problem = model_records.check(shared_root(tmp_path), "org--x", b"{}")
    assert problem and "cannot be trusted" in problem


def test_a_record_another_user_made_is_not_taken_by_anyone_elses_jobs(tmp_path, s3_env, store, monkeypatch):
    """With one shared identity, whoever pushes a name first could have pushed anything: a model whose
    record is not an admin's (root's) or the reader's own is refused, naming who pushed it."""
    from toolkit.models import records as model_records

    assert push(tmp_path, s3_env, write_model_folder(tmp_path / "source"), "org/by-bob").returncode == 0
    os.chown(model_records.record_path(shared_root(tmp_path), "org--by-bob"), 65534, 65534)
    monkeypatch.setenv("FT_MODEL_CACHE_LOCAL", str(tmp_path / "local"))
    if os.getuid() == 0:  # root reads: a record of uid 65534's is not root's
        with pytest.raises(ModelFolderBroken, match="pushed by .* not by an admin or you"):
            find_model("org--by-bob", shared_root(tmp_path), f"s3://{BUCKET}", print)


def test_a_record_that_is_a_link_or_names_another_model_is_refused(tmp_path):
    """The third review's attack: a record linked to another model's record was taken for it."""
    from toolkit.models import records as model_records

    root = shared_root(tmp_path)
    path = model_records.claim(root, "org--8b")
    model_records.write(path, "org--8b", b"{}")
    assert model_records.check(root, "org--8b", b"{}") is None
    os.symlink(path, model_records.record_path(root, "org--70b"))
    assert "cannot be trusted" in model_records.check(root, "org--70b", b"{}")
    copied = model_records.record_path(root, "org--copy")
    copied.write_bytes(path.read_bytes())
    assert "not the record of model org--copy" in model_records.check(root, "org--copy", b"{}")
