"""The registry's mirror, through fsspec: what goes up and in which order, a store that fails losing
nothing on the shared filesystem, and `sync` catching up. The targets here are fsspec's memory://
and a local file:// folder; the lab's S3 server (s3fs against SeaweedFS) is covered by the lead's
lab test of a run that registers and promotes its adapter."""

from __future__ import annotations

import json
import os
import uuid

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from tests.support.adapters import record, write_adapter
from toolkit.base.errors import UsageError
from toolkit.registry.mirror import RegistryMirror
from toolkit.registry.states import State
from toolkit.registry.store import Registry

ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json"]


class Breaking(MemoryFileSystem):
    """The memory store, recording what is written, and failing from the `allowed`+1-th write on (a store
    that goes away half-way). Its objects are every memory store's."""
    cachable = False

    def __init__(self, allowed: int = 10**9):
        super().__init__()
        self.allowed, self.written = allowed, []

    def _writing(self, path: str) -> None:
        if len(self.written) >= self.allowed:
            raise ConnectionError("the store went away")
        self.written.append(path)

    def open(self, path, mode="rb", **kwargs):
        if "w" in mode:  # every write of the memory store, pipe_file's too
            self._writing(path)
        return super().open(path, mode, **kwargs)


@pytest.fixture
def url() -> str:
    return f"memory://registry-{uuid.uuid4().hex[:8]}/registry"


def make(tmp_path, url: str, store=None) -> tuple[Registry, list[str]]:
    (tmp_path / "shared").mkdir(exist_ok=True)
    warnings: list[str] = []
    return Registry.for_shared_root(str(tmp_path / "shared"), RegistryMirror(url, filesystem=store),
                                    warnings.append), warnings


def mirrored(url: str) -> dict[str, bytes]:
    memory, base = MemoryFileSystem(), url.removeprefix("memory:/")
    return {key.removeprefix(base + "/"): memory.cat_file(key) for key in memory.find(base)}


def test_a_version_goes_up_files_first_and_its_record_last(tmp_path, url):
    store = Breaking()
    registry, warnings = make(tmp_path, url, store)
    version = registry.register(write_adapter(tmp_path / "adapter"), record())
    assert warnings == []
    prefix = f"versions/{version.id}"
    expected = [f"{prefix}/adapter/{name}" for name in ADAPTER_FILES] + [f"{prefix}/serving.json",
                                                                        f"{prefix}/version.json"]
    assert [path.split("/registry/", 1)[1] for path in store.written] == expected
    objects = mirrored(url)
    assert sorted(objects) == sorted(expected)
    for key, content in objects.items():
        assert content == (registry.layout.root / key).read_bytes()


def test_a_promotion_mirrors_the_names_log_and_promoted_json(tmp_path, url):
    registry, warnings = make(tmp_path, url)
    version = registry.register(write_adapter(tmp_path / "adapter"), record())
    registry.promote(version.id)
    objects = mirrored(url)
    for key in ("names/tiny-lora-sft/log.jsonl", "names/tiny-lora-sft/promoted.json"):
        assert objects[key] == (registry.layout.root / key).read_bytes()
    assert json.loads(objects["names/tiny-lora-sft/promoted.json"])["version"] == version.id
    assert warnings == []


def test_a_store_that_fails_loses_nothing_and_sync_uploads_it_later(tmp_path, url):
    registry, warnings = make(tmp_path, url, Breaking(allowed=0))
    version = registry.register(write_adapter(tmp_path / "adapter"), record())
    registry.promote(version.id)
    assert [w.split(" (")[0] for w in warnings] == [
        f"version {version.short_id} is not in the mirror {url} yet", f"the log of tiny-lora-sft is not in the "
                                                                       f"mirror {url} yet"]
    assert all("the shared filesystem has it, and `ft adapters sync` uploads it" in w for w in warnings)
    assert registry.version(version.id).state == State.promoted  # the truth is the shared filesystem's
    assert mirrored(url) == {}

    back, _ = make(tmp_path, url)  # the store is back
    report = back.sync()
    assert (report.versions, report.names, report.problems) == ([version.id], ["tiny-lora-sft"], [])
    assert len(mirrored(url)) == len(ADAPTER_FILES) + 4
    again = back.sync()
    assert (again.versions, again.names, again.problems) == ([], [], [])


def test_an_upload_cut_short_is_no_version_in_the_mirror_until_sync_finishes_it(tmp_path, url):
    registry, warnings = make(tmp_path, url, Breaking(allowed=2))
    version = registry.register(write_adapter(tmp_path / "adapter"), record())
    assert len(warnings) == 1 and "ConnectionError: the store went away" in warnings[0]
    assert f"versions/{version.id}/version.json" not in mirrored(url)
    report = make(tmp_path, url)[0].sync()
    assert report.versions == [version.id]
    assert f"versions/{version.id}/version.json" in mirrored(url)


def test_a_failing_store_stops_sync_at_once(tmp_path, url):
    registry, _ = make(tmp_path, url, Breaking(allowed=0))
    for seed in range(3):
        registry.register(write_adapter(tmp_path / f"adapter-{seed}", seed), record())
    report = registry.sync()
    assert len(report.problems) == 2 and "ConnectionError: the store went away" in report.problems[0]
    assert report.problems[1] == "the store is failing: 3 more left for a later sync"  # 2 versions and a name


def test_a_version_whose_files_changed_is_not_mirrored(tmp_path, url):
    registry, _ = make(tmp_path, url, Breaking(allowed=0))
    version = registry.register(write_adapter(tmp_path / "adapter"), record())
    os.chmod(version.adapter, 0o755)
    os.chmod(version.adapter / "tokenizer.json", 0o644)
    (version.adapter / "tokenizer.json").write_text('{"model": "swapped"}')
    report = make(tmp_path, url)[0].sync()
    assert report.versions == [] and len(report.problems) == 1
    assert "tokenizer.json is not the file registered" in report.problems[0]
    assert f"versions/{version.id}/version.json" not in mirrored(url)


def test_a_local_folder_mirror_holds_the_registry_as_it_is(tmp_path):
    target = tmp_path / "bucket"
    registry, warnings = make(tmp_path, f"file://{target}/registry")
    version = registry.register(write_adapter(tmp_path / "adapter"), record())
    registry.promote(version.id)
    assert warnings == []
    local = {path.relative_to(registry.layout.root): path.read_bytes()
             for path in registry.layout.root.rglob("*") if path.is_file() and path.name != ".lock"}
    remote = {path.relative_to(target / "registry"): path.read_bytes()
              for path in (target / "registry").rglob("*") if path.is_file()}
    assert remote == local


def test_the_mirror_lives_under_the_clusters_s3_prefix(tmp_path):
    assert RegistryMirror.for_prefix("s3://ft-checkpoints/site/", "http://127.0.0.1:9").url == \
        "s3://ft-checkpoints/site/registry"
    assert RegistryMirror.for_prefix("") is None
    (tmp_path / "shared").mkdir()
    with pytest.raises(UsageError, match="has no mirror"):
        Registry.for_shared_root(str(tmp_path / "shared")).sync()


@pytest.mark.parametrize("altered", ["adapter/adapter_model.safetensors", "version.json", "serving.json"])
def test_sync_repairs_a_version_changed_in_the_store_by_whoever_can_write_it(tmp_path, url, altered):
    """Every user's jobs may write the registry's prefix: a planted adapter of the same size, or an
    edited record, is found by the next sync and replaced by the registered one."""
    registry, _ = make(tmp_path, url)
    version = registry.register(write_adapter(tmp_path / "adapter"), record())
    key = f"{url.removeprefix('memory:/')}/versions/{version.id}/{altered}"
    memory = MemoryFileSystem()
    original = memory.cat_file(key)
    memory.pipe_file(key, bytes(reversed(original)))  # same size, other bytes
    report = registry.sync()
    assert (report.versions, report.problems) == ([version.id], [])
    objects = mirrored(url)
    for name, content in objects.items():
        if name.startswith(f"versions/{version.id}/"):
            assert content == (registry.layout.root / name).read_bytes(), name
    assert registry.sync().versions == []  # whole again: nothing more to do


def test_sync_removes_files_planted_beside_a_mirrored_adapter(tmp_path, url):
    """A file added to the version's adapter folder in the store (a server would load it beside the
    adapter): the copy is not the registered one, and sync puts back exactly the registered files."""
    registry, _ = make(tmp_path, url)
    version = registry.register(write_adapter(tmp_path / "adapter"), record())
    planted = f"{url.removeprefix('memory:/')}/versions/{version.id}/adapter/new_embeddings.safetensors"
    MemoryFileSystem().pipe_file(planted, b"planted")
    assert registry.sync().versions == [version.id]
    assert f"versions/{version.id}/adapter/new_embeddings.safetensors" not in mirrored(url)
    assert registry.sync().versions == []


def test_sync_removes_files_planted_anywhere_in_a_mirrored_version(tmp_path, url):
    registry, _ = make(tmp_path, url)
    version = registry.register(write_adapter(tmp_path / "adapter"), record())
    MemoryFileSystem().pipe_file(f"{url.removeprefix('memory:/')}/versions/{version.id}/README.md", b"planted")
    assert registry.sync().versions == [version.id]
    assert f"versions/{version.id}/README.md" not in mirrored(url)
