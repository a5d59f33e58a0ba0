"""The adapter registry on the shared filesystem: versions by content, hostile adapter folders, states
and their refusals, who may move a name, and the handoff a serving fleet loads. Another user is played
by chown to an unused uid (as tests/unit/test_shared_dirs.py does: these tests need root)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tests.support.adapters import DIGEST, evaluation, record, write_adapter
from tests.support.model_folders import write_model_folder
from toolkit.base.errors import UsageError
from toolkit.base.shared_dirs import SharedFolderError
from toolkit.registry import adapter, states
from toolkit.registry.adapter import AdapterRefused, content_id
from toolkit.registry.handoff import FORMAT
from toolkit.registry.layout import RegistryLayout
from toolkit.registry.mirror import RegistryMirror
from toolkit.registry.states import State
from toolkit.registry.store import PromotionRefused, Registry, RegistryError

OTHER_UID = 4242
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="plays another user with chown, which needs root")


@pytest.fixture
def registry(tmp_path) -> Registry:
    (tmp_path / "shared").mkdir()
    return Registry.for_shared_root(str(tmp_path / "shared"))


def registered(registry: Registry, tmp_path: Path, seed: int = 0, **fields):
    return registry.register(write_adapter(tmp_path / f"adapter-{seed}", seed), record(**fields))


def log_lines(registry: Registry, name: str = "tiny-lora-sft") -> list[dict]:
    path = registry.layout.log(name)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# -- registering ------------------------------------------------------------------------------
def test_a_version_is_its_files_hash_copied_in_read_only_with_its_record(registry, tmp_path):
    version = registered(registry, tmp_path)
    layout = registry.layout
    assert version.state == State.draft
    assert version.folder == layout.version(version.id)
    assert sorted(os.listdir(version.adapter)) == ["adapter_config.json", "adapter_model.safetensors",
                                                    "tokenizer.json", "tokenizer_config.json"]
    # The id is the sha256 of the files' sha256sum lines: a fleet or an admin recomputes it.
    assert version.id == content_id({name: adapter.digest_of(version.adapter / name)
                                     for name in os.listdir(version.adapter)})
    written = json.loads(layout.version_record(version.id).read_text())
    assert written["name"] == "tiny-lora-sft" and written["run_id"] == "tiny-lora-sft-20250101-abcdefgh"
    assert written["data_digests"] == {"train.jsonl": DIGEST} and written["eval"]["passed"] is True
    assert written["creator_uid"] == os.getuid() and written["lora"]["rank"] == 8
    assert stat.S_IMODE(version.folder.stat().st_mode) == 0o555
    assert stat.S_IMODE(version.adapter.stat().st_mode) == 0o555
    assert {stat.S_IMODE(path.stat().st_mode) for path in version.adapter.iterdir()} == {0o444}
    # The registry's folders are common, as the runs root is; the name's folder its owner's.
    assert stat.S_IMODE(layout.versions.stat().st_mode) == 0o1777
    assert stat.S_IMODE(layout.name("tiny-lora-sft").stat().st_mode) == 0o755
    assert [path.name for path in layout.versions.iterdir()] == [version.id]  # no staging left


def test_the_same_adapter_registered_twice_is_one_version_with_its_first_record(registry, tmp_path):
    first = registered(registry, tmp_path)
    again = registry.register(write_adapter(tmp_path / "elsewhere"), record(run_id="tiny-lora-sft-20250102-x"))
    assert again.id == first.id and again.record.run_id == first.record.run_id
    other = registered(registry, tmp_path, seed=1)
    assert other.id != first.id
    assert {version.id for version in registry.versions()} == {first.id, other.id}


def test_a_version_is_named_by_any_unique_prefix_of_its_id(registry, tmp_path):
    version = registered(registry, tmp_path)
    assert registry.version(version.id[:4]).id == version.id
    assert registry.version(version.id.upper()[:10]).id == version.id
    with pytest.raises(RegistryError, match="no version 0000") as missing:
        registry.version("0000" if not version.id.startswith("0000") else "ffff")
    assert missing.value.exit_code == 2
    with pytest.raises(UsageError, match="is not a version id"):
        registry.version("../x")


def test_a_prefix_that_names_several_versions_is_refused(registry, tmp_path):
    ids = [registered(registry, tmp_path, seed).id for seed in range(17)]  # two share a first digit
    shared = next(version_id[0] for version_id in ids if sum(other[0] == version_id[0] for other in ids) > 1)
    with pytest.raises(UsageError, match=f"{shared} names [0-9]+ versions") as refused:
        registry.version(shared)
    assert refused.value.exit_code == 2 and refused.value.hint == "give more of the id"


def test_a_failure_half_way_leaves_no_version_and_no_staging(registry, tmp_path, monkeypatch):
    def broken(folder):
        raise OSError("disk full")
    monkeypatch.setattr("toolkit.registry.store.lora_shape", broken)
    with pytest.raises(RegistryError, match="disk full"):
        registered(registry, tmp_path)
    assert list(registry.layout.versions.iterdir()) == []


@pytest.mark.parametrize("hostile, refusal", [
    ("symlink", "is a symlink: an adapter folder holds regular files only"),
    ("fifo", "is a FIFO"),
    ("folder", "is a folder"),
    ("hidden", "no hidden files"),
    ("many", "more than 64 files"),
])
def test_a_hostile_adapter_folder_is_refused_naming_what(registry, tmp_path, hostile, refusal):
    folder = write_adapter(tmp_path / "adapter")
    if hostile == "symlink":
        (folder / "tokenizer.json").unlink()
        (folder / "tokenizer.json").symlink_to("/etc/shadow")
    elif hostile == "fifo":
        os.mkfifo(folder / "special_tokens_map.json")  # never opened: it would block a reader
    elif hostile == "folder":
        (folder / "nested").mkdir()
    elif hostile == "hidden":
        (folder / ".git-credentials").write_text("x")
    else:
        for index in range(64):
            (folder / f"extra-{index}.txt").write_text("x")
    with pytest.raises(AdapterRefused, match=refusal) as refused:
        registry.register(folder, record())
    assert refused.value.exit_code == 2
    assert not registry.layout.versions.exists() or list(registry.layout.versions.iterdir()) == []


def test_an_adapter_folder_that_is_a_symlink_is_refused(registry, tmp_path):
    (tmp_path / "link").symlink_to(write_adapter(tmp_path / "adapter"))
    with pytest.raises(AdapterRefused, match="is a symlink, not an adapter folder"):
        registry.register(tmp_path / "link", record())


def test_a_huge_adapter_is_refused_before_a_byte_is_read(registry, tmp_path):
    folder = write_adapter(tmp_path / "adapter")
    with open(folder / "huge.safetensors", "wb") as huge:
        huge.truncate(adapter.MAX_ADAPTER_BYTES + 1)  # sparse: no disk spent
    with pytest.raises(AdapterRefused, match="over the registry's 16 GiB"):
        registry.register(folder, record())


def test_a_file_that_grows_while_it_is_copied_is_refused(tmp_path):
    path = tmp_path / "weights"
    path.write_bytes(b"x" * 100)
    descriptor, size = adapter.open_descriptor(path)
    try:
        with open(path, "ab") as more:
            more.write(b"y")
        with pytest.raises(AdapterRefused, match="grew while it was read"):
            adapter.stream(descriptor, size, path)
    finally:
        os.close(descriptor)


def test_a_full_fine_tune_is_not_a_lora_adapter(registry, tmp_path):
    with pytest.raises(AdapterRefused, match="holds a model's weights, not a LoRA adapter") as refused:
        registry.register(write_model_folder(tmp_path / "full"), record())
    assert "ft model push" in refused.value.hint


@pytest.mark.parametrize("damage, refusal", [
    ("no weights", "adapter_model.safetensors missing"),
    ("pickled weights", "adapter_model.safetensors missing"),
    ("no config", "adapter_config.json missing"),
    ("not lora", "'IA3' adapter: the registry takes LoRA adapters"),
    ("no rank", "adapter_config.json: r:"),
    ("truncated weights", "weights are not whole"),
])
def test_an_adapter_that_is_not_a_whole_lora_is_refused(registry, tmp_path, damage, refusal):
    folder = write_adapter(tmp_path / "adapter")
    config = json.loads((folder / "adapter_config.json").read_text())
    if damage in ("no weights", "pickled weights"):
        (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    elif damage == "no config":
        (folder / "adapter_config.json").unlink()
    elif damage == "not lora":
        (folder / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    elif damage == "no rank":
        (folder / "adapter_config.json").write_text(json.dumps({**config, "r": "8"}))
    else:
        weights = folder / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-10])
    with pytest.raises(AdapterRefused, match=refusal):
        registry.register(folder, record())


# -- states -----------------------------------------------------------------------------------
def test_promoting_deprecates_the_version_promoted_before_in_the_same_write(registry, tmp_path):
    first, second = registered(registry, tmp_path, 0), registered(registry, tmp_path, 1)
    change = registry.promote(first.id[:8], reason="beats the base")
    assert change.version.state == State.promoted and len(change.transitions) == 1
    change = registry.promote(second.id)
    assert [(m.version, m.from_state, m.to_state) for m in change.transitions] == [
        (first.id, State.promoted, State.deprecated), (second.id, State.draft, State.promoted)]
    assert {v.id: v.state for v in registry.versions()} == {first.id: State.deprecated, second.id: State.promoted}
    lines = log_lines(registry)
    assert [(line["from"], line["to"]) for line in lines] == [("draft", "promoted"), ("promoted", "deprecated"),
                                                              ("draft", "promoted")]
    assert lines[0]["reason"] == "beats the base" and lines[1]["reason"] == f"superseded by {second.id[:12]}"
    assert {line["user"] for line in lines} == {"root" if os.getuid() == 0 else lines[0]["user"]}
    assert registry.promote(second.id).transitions == []  # promoted already: nothing written
    assert len(log_lines(registry)) == 3


def test_a_version_that_failed_a_gate_is_never_promoted(registry, tmp_path):
    version = registered(registry, tmp_path, passed=False)
    with pytest.raises(PromotionRefused) as refused:
        registry.promote(version.id)
    assert refused.value.exit_code == 2
    assert "is never promoted: it failed 1 gate(s) (beats_base: eval loss 1.70 >= base 1.60)" in refused.value.message
    assert registry.version(version.id).state == State.draft
    assert not registry.layout.log("tiny-lora-sft").exists()


@pytest.mark.parametrize("evaluation, refusal", [
    ({}, "has no evaluation result"),
    ({"passed": False, "gates": []}, "its evaluation did not pass"),
    ({"passed": True, "gates": [{"name": "safety", "passed": "yes"}]}, "failed 1 gate"),
])
def test_promotion_needs_an_evaluation_that_passed(registry, tmp_path, evaluation, refusal):
    version = registered(registry, tmp_path, eval=evaluation)
    with pytest.raises(PromotionRefused, match=refusal):
        registry.promote(version.id)


def test_a_deprecated_version_is_never_promoted_again(registry, tmp_path):
    version = registered(registry, tmp_path)
    assert registry.deprecate(version.id, reason="bad outputs").version.state == State.deprecated
    with pytest.raises(PromotionRefused, match="was deprecated: it is never promoted again"):
        registry.promote(version.id)
    assert registry.deprecate(version.id).transitions == []
    assert [(line["from"], line["to"]) for line in log_lines(registry)] == [("draft", "deprecated")]


def test_deprecating_the_promoted_version_leaves_its_name_serving_none(registry, tmp_path):
    version = registered(registry, tmp_path)
    registry.promote(version.id)
    registry.deprecate(version.id)
    pointer = json.loads(registry.layout.promoted("tiny-lora-sft").read_text())
    assert pointer == {"format": FORMAT, "name": "tiny-lora-sft", "version": None}


def test_promoted_json_follows_the_log_and_a_lost_one_is_mended_by_the_next_move(registry, tmp_path):
    version = registered(registry, tmp_path)
    registry.promote(version.id)
    pointer = registry.layout.promoted("tiny-lora-sft")
    written = pointer.read_text()
    pointer.unlink()  # a failure after the log was written
    assert registry.promote(version.id).transitions == []
    assert pointer.read_text() == written


def test_a_version_whose_files_changed_since_it_was_registered_is_never_promoted(registry, tmp_path):
    version = registered(registry, tmp_path)
    weights = version.adapter / "adapter_model.safetensors"
    os.chmod(version.adapter, 0o755)
    os.chmod(weights, 0o644)
    weights.write_bytes(weights.read_bytes()[:-4] + b"\1\1\1\1")
    with pytest.raises(PromotionRefused, match="files are not those registered"):
        registry.promote(version.id)


def test_a_torn_line_is_skipped_said_and_the_next_move_starts_a_line_of_its_own(registry, tmp_path):
    first, second = registered(registry, tmp_path, 0), registered(registry, tmp_path, 1)
    registry.promote(first.id)
    with open(registry.layout.log("tiny-lora-sft"), "a") as log:
        log.write('{"version": "' + second.id[:20])  # a crash mid-write
    history = registry.history("tiny-lora-sft")
    assert history.promoted == first.id and history.skipped == ["line 2: not a transition (torn or damaged)"]
    registry.promote(second.id)
    history = registry.history("tiny-lora-sft")
    assert history.promoted == second.id and len(history.transitions) == 3 and len(history.skipped) == 1


def test_moves_that_do_not_follow_are_left_out_of_the_history():
    move = states.Transition("a" * 64, State.draft, State.promoted, "u", 1, 1.0, "")
    other = states.Transition("b" * 64, State.draft, State.promoted, "u", 1, 2.0, "")
    back = states.Transition("a" * 64, State.deprecated, State.draft, "u", 1, 3.0, "")
    history = states.replay("\n".join(m.to_json() for m in (move, other, back)))
    assert history.promoted == "a" * 64 and len(history.transitions) == 1
    assert history.skipped == [f"line 2: {'b' * 12} promoted while {'a' * 12} still was",
                               f"line 3: {'a' * 12} deprecated -> draft, but it was promoted"]


@pytest.mark.parametrize("planted", ["symlink", "fifo", "huge"])
def test_a_log_that_is_not_a_bounded_regular_file_is_never_read(registry, tmp_path, planted, monkeypatch):
    version = registered(registry, tmp_path)
    log = registry.layout.log("tiny-lora-sft")
    if planted == "symlink":
        log.symlink_to("/etc/passwd")
    elif planted == "fifo":
        os.mkfifo(log)
    else:
        monkeypatch.setattr(states, "MAX_LOG_BYTES", 10)
        log.write_text("x" * 11)
    with pytest.raises(RegistryError, match="the log of tiny-lora-sft cannot be read"):
        registry.history("tiny-lora-sft")
    with pytest.raises(RegistryError):
        registry.promote(version.id)


# -- who may move a name ----------------------------------------------------------------------
def test_only_the_names_owner_or_root_promotes(registry, tmp_path, monkeypatch):
    version = registered(registry, tmp_path)
    monkeypatch.setattr(os, "getuid", lambda: OTHER_UID)
    with pytest.raises(PromotionRefused, match="adapter name tiny-lora-sft is .*'s: only they, or root") as refused:
        registry.promote(version.id)
    assert refused.value.exit_code == 2
    with pytest.raises(PromotionRefused, match="only they, or root"):
        registry.deprecate(version.id)
    assert not registry.layout.log("tiny-lora-sft").exists()


@needs_root
def test_root_moves_another_users_name_and_the_log_stays_theirs(registry, tmp_path):
    version = registered(registry, tmp_path)
    os.chown(registry.layout.name("tiny-lora-sft"), OTHER_UID, OTHER_UID)
    registry.promote(version.id)
    assert registry.layout.log("tiny-lora-sft").stat().st_uid == OTHER_UID  # they append to it afterwards
    assert registry.version(version.id).state == State.promoted


@needs_root
def test_a_version_whose_record_claims_another_creator_is_not_a_version(registry, tmp_path):
    version = registered(registry, tmp_path)
    os.chown(version.folder, OTHER_UID, OTHER_UID)  # the folder's owner says who made it, not the record
    assert registry.versions() == []
    with pytest.raises(RegistryError, match="names another id or creator than its folder's"):
        registry.version(version.id)


def test_a_version_with_the_largest_evaluation_allowed_is_read_back(registry, tmp_path):
    """Indented, an evaluation of many numbers takes three times its room: such a record is written
    compact, within the bound listing reads (never a version placed that ft then refuses)."""
    scores = [0.5] * 50_000  # about 250 KB as JSON: just within MAX_EVAL_BYTES
    evaluation_ = dict(evaluation(), scores=scores)
    version = registered(registry, tmp_path, eval=evaluation_)
    assert [listed.id for listed in registry.versions()] == [version.id]
    assert registry.version(version.short_id).record.eval["scores"] == scores


def test_a_bloated_record_is_skipped_unread(registry, tmp_path, monkeypatch):
    from toolkit.registry import store

    version = registered(registry, tmp_path)
    planted = registry.layout.versions / ("f" * 64)  # a version folder with a 4 MiB record, as planted
    planted.mkdir()
    written = json.loads(registry.layout.version_record(version.id).read_text())
    written.update(id="f" * 64, reason="x" * (4 << 20))
    (planted / "version.json").write_text(json.dumps(written))
    parsed = []
    real = store.VersionRecord.model_validate_json
    monkeypatch.setattr(store.VersionRecord, "model_validate_json", lambda text: parsed.append(len(text)) or real(text))
    assert [listed.id for listed in registry.versions()] == [version.id]
    assert max(parsed) < store.MAX_VERSION_RECORD_BYTES  # the planted one was never parsed
    with pytest.raises(RegistryError, match="is over"):
        registry.version("f" * 12)


@needs_root
def test_a_registry_folder_another_user_made_is_never_read(registry, tmp_path):
    registered(registry, tmp_path)
    os.chown(registry.layout.versions, OTHER_UID, OTHER_UID)  # they could rename anything in it
    with pytest.raises(SharedFolderError, match=f"versions belongs to uid {OTHER_UID}"):
        registry.versions()


@pytest.mark.parametrize("made", ["writable by others", "a symlink"])
def test_a_names_folder_others_could_write_is_not_trusted(registry, tmp_path, made):
    version = registered(registry, tmp_path)
    folder = registry.layout.name("tiny-lora-sft")
    if made == "a symlink":
        folder.rename(tmp_path / "moved")
        folder.symlink_to(tmp_path / "moved")
    else:
        folder.chmod(0o777)
    with pytest.raises(RegistryError, match="is not a name's folder to trust"):
        registry.promote(version.id)


def test_without_a_shared_root_the_registry_is_private(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    registry = Registry.for_shared_root("")
    version = registry.register(write_adapter(tmp_path / "adapter"), record())
    assert registry.layout.root == tmp_path / "ft" / "registry"
    assert stat.S_IMODE(registry.layout.root.stat().st_mode) == 0o700
    assert registry.version(version.id[:6]).id == version.id


# -- the handoff -------------------------------------------------------------------------------
def test_the_handoff_names_the_base_the_files_and_where_a_fleet_finds_them(tmp_path):
    (tmp_path / "shared").mkdir()
    registry = Registry.for_shared_root(str(tmp_path / "shared"), RegistryMirror("memory://handoff/registry"))
    version = registered(registry, tmp_path)
    serving = json.loads(registry.layout.serving(version.id).read_text())
    files = serving["adapter"].pop("files")
    assert serving == {
        "format": FORMAT, "name": "tiny-lora-sft", "version": version.id,
        "base_model": {"name": "meta-llama/Llama-3.1-8B", "revision": "main"},
        "adapter": {"path": str(version.adapter),
                    "s3_uri": f"memory://handoff/registry/versions/{version.id}/adapter"},
        "lora": {"peft_type": "LORA", "rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"]},
        "lora_modules": f"tiny-lora-sft={version.adapter}",
    }
    assert sorted(files) == ["adapter_config.json", "adapter_model.safetensors", "tokenizer.json",
                             "tokenizer_config.json"]
    for name, entry in files.items():
        assert entry == adapter.digest_of(version.adapter / name).model_dump()
    registry.promote(version.id, reason="beats the base")
    pointer = json.loads(registry.layout.promoted("tiny-lora-sft").read_text())
    assert pointer["version"] == version.id and pointer["serving"]["adapter"]["files"] == files
    assert pointer["promoted"]["reason"] == "beats the base"


def test_the_layout_names_the_same_paths_for_the_mirror(tmp_path):
    layout = RegistryLayout(tmp_path)
    assert layout.relative(layout.adapter("a" * 64)) == f"versions/{'a' * 64}/adapter"
    assert layout.relative(layout.log("tiny")) == "names/tiny/log.jsonl"


def test_a_promoted_version_made_unusable_by_its_creator_serves_none_and_blocks_nothing(registry, tmp_path):
    first, second = registered(registry, tmp_path, 0), registered(registry, tmp_path, 1)
    registry.promote(first.id)
    os.chmod(registry.layout.version(first.id), 0o777)  # its creator opens it to everyone: never trusted
    registry.deprecate(second.id)  # the name's other moves go on
    pointer = json.loads(registry.layout.promoted("tiny-lora-sft").read_text())
    assert pointer["version"] is None  # nothing served rather than files anyone could change
    os.chmod(registry.layout.version(first.id), 0o555)


def test_a_file_of_another_size_is_a_change_found_without_hashing(registry, tmp_path, monkeypatch):
    version = registered(registry, tmp_path, 0)
    assert not registry.files_changed(version)
    weights = version.adapter / "adapter_model.safetensors"
    os.chmod(version.adapter, 0o755)
    os.chmod(weights, 0o644)
    with open(weights, "ab") as handle:
        handle.write(b"\0")
    monkeypatch.setattr("toolkit.registry.store.digest_of", lambda *_: pytest.fail("hashed"))
    assert registry.files_changed(version)
