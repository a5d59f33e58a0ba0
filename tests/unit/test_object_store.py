"""toolkit/storage/object_store.py: one place makes fsspec filesystems, one rule says what an S3 URL is."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

from toolkit.storage.object_store import ObjectStore, parse_s3_url, within

TOOLKIT = Path(__file__).resolve().parents[2] / "toolkit"


@pytest.mark.parametrize(("url", "bucket", "key"), [
    ("s3://my-bucket", "my-bucket", ""),
    ("s3://my-bucket/", "my-bucket", ""),
    ("s3://data.example/a/b/train.jsonl", "data.example", "a/b/train.jsonl"),
    ("s3://abc/prefix/", "abc", "prefix"),
    ("s3://ab/x", "ab", "x"),  # short and legacy names: other stores and us-east-1 have them
    ("s3://Legacy_Bucket/ckpt", "Legacy_Bucket", "ckpt"),
    ("s3://b-1/runs/a=1/part+2@v,3~/f.jsonl", "b-1", "runs/a=1/part+2@v,3~/f.jsonl"),
    # What S3 keys hold in the wild: timestamps, %-encoded hive partitions, spaces, logins, non-ASCII.
    ("s3://dd/events/dt=2024-01-01T00:00:00/part-0.jsonl", "dd", "events/dt=2024-01-01T00:00:00/part-0.jsonl"),
    ("s3://dd/ts=2024-01-01 00%3A00%3A00/chat (v2)/données.jsonl", "dd",
     "ts=2024-01-01 00%3A00%3A00/chat (v2)/données.jsonl"),
    ("s3://ft-checkpoints/users/CORP\\jdoe/runs/r1", "ft-checkpoints", "users/CORP\\jdoe/runs/r1"),
])
def test_an_s3_url_names_a_bucket_and_maybe_a_key(url, bucket, key):
    parsed = parse_s3_url(url)
    assert (parsed.bucket, parsed.key) == (bucket, key)


@pytest.mark.parametrize("url", ["s3://", "s3://a", "s3://-bad/key", "s3:/one-slash/key", "https://bucket/key",
                                 "s3://bucket/line\nbreak", "s3://" + "b" * 256, "s3://bucket/site::x",
                                 "s3://bucket/key?versionId=1", "s3://bucket::x/key", "s3://bucket/tab\there"])
def test_what_is_not_an_s3_url_is_refused_with_the_shape_wanted(url):
    """'::' chains filesystems in fsspec and '?versionId=' picks an object version: a prefix holding
    them lost every run's own part of the path (all runs' checkpoints in one place)."""
    with pytest.raises(ValueError, match=r"s3://bucket\[/prefix\]"):
        parse_s3_url(url)


def test_a_data_file_needs_a_key_and_the_recipe_and_the_profile_share_the_rule():
    with pytest.raises(ValueError, match="s3://bucket/path/file"):
        parse_s3_url("s3://bucket", "a data file", needs_key=True)
    from pydantic import ValidationError

    from toolkit.cluster.profile import ClusterProfile
    from toolkit.recipe.schema import DataSpec

    with pytest.raises(ValidationError, match="is not a data file's S3 URL"):
        DataSpec(train="s3://bucket/a::b/train.jsonl")
    with pytest.raises(ValidationError, match="is not an S3 prefix"):
        ClusterProfile(name="c", s3_prefix="s3://ft-checkpoints/site::x", gpus_per_node=0,
                       tiers={"standard": {"partition": "p"}})


def test_the_environment_names_the_endpoint_before_the_profile(monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    store = ObjectStore("http://10.0.0.1:8333")
    assert store.endpoint == "http://10.0.0.1:8333"
    assert store.s3_options()["endpoint_url"] == "http://10.0.0.1:8333"
    assert store.where("s3://b/k") == "the object store at http://10.0.0.1:8333"
    assert store.where("/data/train.jsonl") == "the local filesystem"
    assert ObjectStore().where("s3://b/k") == "AWS S3" and "endpoint_url" not in ObjectStore().s3_options()
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    assert store.endpoint == "http://127.0.0.1:9000"


def test_each_filesystem_carries_its_own_store_whatever_was_made_before(monkeypatch):
    """The old process-wide configuration let the first caller decide for all: two stores in one
    process now each reach their own endpoint, in either order, and fsspec's global stays empty."""
    import fsspec.config

    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    first, second = ObjectStore("http://127.0.0.1:1"), ObjectStore("http://127.0.0.1:2")
    for a, b in ((first, second), (second, first)):
        fs_a, path_a = a.filesystem("s3://bucket-a/x")
        fs_b, _ = b.filesystem("s3://bucket-b/y")
        assert fs_a.endpoint_url == a.endpoint
        assert fs_b.endpoint_url == b.endpoint and path_a == "bucket-a/x"
        assert fs_a.config_kwargs["connect_timeout"] == 5  # bounded, on every filesystem
    assert "s3" not in fsspec.config.conf


def test_a_local_path_is_the_local_filesystem(tmp_path):
    (tmp_path / "f.txt").write_text("hello")
    filesystem, path = ObjectStore("http://127.0.0.1:1").filesystem(str(tmp_path / "f.txt"))
    assert filesystem.protocol[0] in ("file", "local") and filesystem.cat_file(path) == b"hello"
    with ObjectStore().open(str(tmp_path / "f.txt")) as handle:
        assert handle.read() == b"hello"
    assert ObjectStore().presence(str(tmp_path / "f.txt")).found
    assert not ObjectStore().presence(str(tmp_path / "absent")).found


def test_a_refused_connection_is_unreachable_not_missing(monkeypatch):
    import socket

    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    found = ObjectStore(f"http://127.0.0.1:{port}").presence("s3://bucket/train.jsonl", deadline_s=20)
    assert not found.found and found.unreachable and "no answer" not in found.unreachable


def test_within_gives_up_on_a_call_that_never_returns_and_passes_errors_on():
    started = time.monotonic()
    assert not within(lambda: time.sleep(30), 0.2).in_time
    assert time.monotonic() - started < 5
    failed = within(lambda: 1 / 0, 5)
    assert failed.in_time and isinstance(failed.error, ZeroDivisionError)
    assert within(lambda: 42, 5).value == 42


def test_credentials_are_looked_for_only_off_aws(monkeypatch, tmp_path):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_WEB_IDENTITY_TOKEN_FILE",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):
        monkeypatch.delenv(name, raising=False)
    assert ObjectStore().credentials_visible()  # AWS itself: an instance role may hold them
    lab = ObjectStore("http://127.0.0.1:8333")
    assert not lab.credentials_visible()
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "credentials").write_text("[default]\n")
    assert lab.credentials_visible()


def test_only_the_storage_package_imports_fsspec():
    """`git grep` finds fsspec opened in one module: the import graph says so for every file."""
    importers = []
    for path in TOOLKIT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(name == "fsspec" or name.startswith("fsspec.") for name in names):
                importers.append(str(path.relative_to(TOOLKIT)))
    assert importers and set(importers) == {"storage/object_store.py"}
