"""Checkpoints a run can prove are its owner's (issue 34, item 1): every manifest ft publishes is
sealed with the user's key; a resume takes only sealed ones. The attack this stops: another user with
the same object-store identity plants `step-99999999` (an empty lineage, or any seal of their own)
under the victim's mirror, and the victim's resume adopted it and pruned her own checkpoints for it.
The object store here is a real S3 server (SeaweedFS on loopback)."""

from __future__ import annotations

import json
import os
import uuid

import pytest

from tests.support.s3 import filesystem, s3_server
from tests.unit.test_checkpoint_shared import LINEAGE, write_checkpoint
from toolkit.checkpoint import manifest, seal
from toolkit.checkpoint.manifest import tag_for
from toolkit.checkpoint.remote import RemoteProblem, RemoteTier
from toolkit.checkpoint.seal import Sealer
from toolkit.checkpoint.shared import SharedTier

BUCKET = "sealed"
PLANTED = "step-99999999"


def shared_root(tmp_path) -> str:
    (tmp_path / "shared").mkdir(mode=0o1777, exist_ok=True)
    os.chmod(tmp_path / "shared", 0o1777)
    return str(tmp_path / "shared")


@pytest.fixture
def sealer(tmp_path) -> Sealer:
    return Sealer.for_shared_root(shared_root(tmp_path))


# -- the key --------------------------------------------------------------------------------------

def test_the_key_is_made_once_private_and_read_back_the_same(tmp_path):
    first = Sealer.for_shared_root(shared_root(tmp_path))
    path = seal.key_path(shared_root(tmp_path))
    assert path == tmp_path / "shared" / "keys" / f"uid-{os.getuid()}" / "checkpoint-seal.key"
    assert oct(path.stat().st_mode & 0o777) == "0o600" and len(first.key) == 32
    assert Sealer.for_shared_root(shared_root(tmp_path)).key == first.key  # every later run: the same key
    assert not [name for name in os.listdir(path.parent) if name.startswith(".")]  # no temporary left


def test_a_key_another_process_linked_first_is_the_one_used(tmp_path):
    path = tmp_path / "checkpoint-seal.key"
    path.write_bytes(b"k" * 32)
    assert seal.load_or_make_key(path) == b"k" * 32


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give the key file to another account")
def test_a_key_file_of_another_users_is_refused(tmp_path):
    path = tmp_path / "checkpoint-seal.key"
    path.write_bytes(b"k" * 32)
    os.chown(path, 65534, 65534)
    with pytest.raises(ValueError, match="is not yours"):
        seal.load_or_make_key(path)


def test_a_short_key_file_is_refused_not_replaced(tmp_path):
    path = tmp_path / "checkpoint-seal.key"
    path.write_bytes(b"short")
    with pytest.raises(ValueError, match="not a checkpoint key"):
        seal.load_or_make_key(path)
    assert path.read_bytes() == b"short"


# -- the shared filesystem's tier --------------------------------------------------------------------

def test_published_manifests_carry_a_seal_that_covers_every_field(tmp_path, sealer):
    tier = SharedTier(tmp_path / "ckpt", keep_last=3, sealer=sealer)
    write_checkpoint(tier, 10)
    described = manifest.read(tier.root / tag_for(10))
    assert described.seal and sealer.problem(described) is None
    for changed in ({"step": 11}, {"lineage": "f" * 16}, {"files": {}}):
        from dataclasses import replace
        assert sealer.problem(replace(described, **changed)) is not None


def test_a_checkpoint_rewritten_without_the_key_is_passed_over_for_the_one_before(tmp_path, sealer):
    tier = SharedTier(tmp_path / "ckpt", keep_last=3, sealer=sealer)
    write_checkpoint(tier, 10)
    write_checkpoint(tier, 20)
    newest = tier.root / tag_for(20)
    (newest / "model.pt").write_bytes(b"someone else's weights")
    raw = json.loads((newest / manifest.MANIFEST).read_text())  # the manifest made to match the new file
    raw["files"]["model.pt"] = {"bytes": len(b"someone else's weights"),
                                "sha256": __import__("hashlib").sha256(b"someone else's weights").hexdigest()}
    (newest / manifest.MANIFEST).write_text(json.dumps(raw))
    warnings: list[str] = []
    assert tier.newest_whole(LINEAGE, warnings.append) == tag_for(10)
    assert "its seal is not made with" in warnings[0]


def test_an_unsealed_checkpoint_is_taken_only_where_the_user_owns_it(tmp_path, sealer):
    legacy = SharedTier(tmp_path / "ckpt", keep_last=3)  # an ft before seals wrote these
    write_checkpoint(legacy, 10)
    sealed_tier = SharedTier(tmp_path / "ckpt", keep_last=3, sealer=sealer)
    assert sealed_tier.newest_whole(LINEAGE, print) == tag_for(10)
    if os.getuid() == 0:
        os.chown(tmp_path / "ckpt" / tag_for(10) / manifest.MANIFEST, 65534, 65534)
        warnings: list[str] = []
        assert sealed_tier.newest_whole(LINEAGE, warnings.append) is None
        assert "is not sealed" in warnings[0]


# -- the object store's tier ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def store(tmp_path_factory):
    pytest.importorskip("s3fs")
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        fs = filesystem(server.env)
        fs.mkdir(BUCKET)
        yield fs


def plant(store, remote: RemoteTier, lineage: str = "", seal_with: bytes | None = None) -> None:
    """What the attacker uploads: a whole, self-consistent checkpoint at a far newer step."""
    weights = b"planted weights"
    described = manifest.Manifest(manifest.step_of(PLANTED), {"model.pt": manifest.FileEntry(
        len(weights), __import__("hashlib").sha256(weights).hexdigest())}, lineage)
    if seal_with is not None:
        described = Sealer(seal_with).sealed(described)
    store.pipe_file(remote._path(PLANTED, "model.pt"), weights)
    store.pipe_file(remote._path(PLANTED, manifest.MANIFEST), described.to_json().encode())


def mirrored(tmp_path, store, sealer: Sealer, steps=(10, 20)) -> tuple[SharedTier, RemoteTier]:
    shared = SharedTier(tmp_path / "theirs", keep_last=5, sealer=sealer)
    remote = RemoteTier(f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/checkpoints", keep_last=2, filesystem=store,
                        sealer=sealer)
    for step in steps:
        write_checkpoint(shared, step)
        remote.upload(shared.root / tag_for(step), manifest.read(shared.root / tag_for(step)))
    return shared, remote


@pytest.mark.parametrize("planted", ["an empty lineage", "the attacker's own key"])
def test_a_planted_newer_checkpoint_is_not_resumed_from(tmp_path, store, sealer, planted):
    from toolkit.train.checkpoint import Checkpointer, Tiers

    _, remote = mirrored(tmp_path, store, sealer)
    plant(store, remote, *(("",) if planted == "an empty lineage" else (LINEAGE, b"a" * 32)))
    assert remote.tags()[0] == PLANTED
    with pytest.raises(RemoteProblem, match="no lineage" if planted == "an empty lineage" else "seal is not made"):
        remote.download(PLANTED, tmp_path / "landing", LINEAGE)
    assert not (tmp_path / "landing").exists()
    # The victim's next start (a fresh shared tier: the run's folder was lost) resumes her own step 20.
    chooser = Checkpointer.__new__(Checkpointer)
    warnings: list[str] = []
    chooser.tiers = Tiers(SharedTier(tmp_path / "fresh", keep_last=5, sealer=sealer), remote)
    chooser.lineage, chooser.log = LINEAGE, warnings.append
    assert chooser._choose()[0] == tag_for(20)
    assert any(PLANTED in line and "unusable" in line for line in warnings), warnings


def test_planted_tags_neither_push_the_users_checkpoints_out_nor_are_removed_by_them(tmp_path, store, sealer):
    _, remote = mirrored(tmp_path, store, sealer, steps=(10, 20, 30))
    plant(store, remote, LINEAGE, b"a" * 32)
    remote.prune()
    assert remote.tags() == [PLANTED, tag_for(30), tag_for(20)]  # keep_last 2 of her own; theirs untouched


def test_without_a_sealer_the_tier_takes_any_whole_checkpoint(tmp_path, store, sealer):
    """The model store's use of the same code (no seal: its trust is the registry's record)."""
    _, sealed_remote = mirrored(tmp_path, store, sealer, steps=(10,))
    plant(store, sealed_remote, LINEAGE)
    plain = RemoteTier(sealed_remote.url, keep_last=2, filesystem=store)
    assert plain.download(PLANTED, tmp_path / "landing", LINEAGE).step == manifest.step_of(PLANTED)


def test_her_own_sealed_manifest_copied_under_newer_tags_counts_for_nothing(tmp_path, store, sealer):
    """The second review's attack: a sealed manifest of hers, copied alone under newer tags, made prune
    keep those and remove every real checkpoint. A checkpoint counts as hers only at its own step."""
    _, remote = mirrored(tmp_path, store, sealer, steps=(10, 20, 30))
    remote.lineage = LINEAGE
    hers = store.cat_file(remote._path(tag_for(30), manifest.MANIFEST))
    for copied in ("step-99999998", PLANTED):
        store.pipe_file(remote._path(copied, manifest.MANIFEST), hers)
    assert not remote.owned(PLANTED) and remote.owned(tag_for(30))
    remote.prune()
    assert remote.tags() == [PLANTED, "step-99999998", tag_for(30), tag_for(20)]  # hers kept, theirs left alone


def test_a_staging_folder_another_user_made_first_stops_the_run_before_training(tmp_path):
    from toolkit.runs.exits import RunEnds
    from toolkit.train.checkpoint import staging_folder

    mine = staging_folder(str(tmp_path / "fast" / "mine"))
    assert mine.is_dir() and oct(mine.stat().st_mode & 0o777) == "0o700"
    if os.getuid() == 0:
        taken = tmp_path / "fast" / "taken"
        taken.mkdir(mode=0o777)
        os.chown(taken, 65534, 65534)
        with pytest.raises(RunEnds, match="checkpoint.staging .* cannot hold this run's checkpoints"):
            staging_folder(str(taken))


def test_a_staging_folder_under_a_link_to_another_users_folder_is_refused(tmp_path):
    """The third review's attack: bob makes alice's scratch folder first, as a link to a folder of his;
    her 0700 folder inside it was accepted, and bob, owning its parent, swapped it mid-run."""
    from toolkit.runs.exits import RunEnds
    from toolkit.train.checkpoint import staging_folder

    if os.getuid() != 0:
        pytest.skip("needs root to make a folder of another account's")
    scratch = tmp_path / "scratch"
    scratch.mkdir(mode=0o1777)
    os.chmod(scratch, 0o1777)
    bobs = scratch / "bob-spool"
    bobs.mkdir(mode=0o777)
    os.chown(bobs, 65534, 65534)
    (scratch / "alice").symlink_to(bobs)
    with pytest.raises(RunEnds, match="bob-spool belongs to"):
        staging_folder(str(scratch / "alice" / "llama-ckpt"))
    assert staging_folder(str(scratch / "mine" / "ckpt")).is_dir()  # under a sticky common folder: fine


def test_her_sealed_checkpoints_copied_from_another_runs_mirror_are_not_this_runs(tmp_path, store):
    """The third review's attack: her run r1's sealed manifests copied into run r2's mirror counted as
    r2's (prune removed r2's real ones). A seal is for one mirror: r1's are not r2's."""
    root = shared_root(tmp_path)
    first = RemoteTier(f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/r1", keep_last=2, filesystem=store, lineage=LINEAGE)
    second = RemoteTier(f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/r2", keep_last=2, filesystem=store, lineage=LINEAGE)
    for remote, steps in ((first, (100, 200)), (second, (10, 20, 30))):
        remote.sealer = Sealer.for_shared_root(root, remote.url)
        shared = SharedTier(tmp_path / remote.url.rsplit("/", 1)[-1], keep_last=5, sealer=remote.sealer)
        for step in steps:
            write_checkpoint(shared, step)
            remote.upload(shared.root / tag_for(step), manifest.read(shared.root / tag_for(step)))
    for step in (100, 200):
        store.pipe_file(second._path(tag_for(step), manifest.MANIFEST),
                        store.cat_file(first._path(tag_for(step), manifest.MANIFEST)))
    assert not second.owned(tag_for(200)) and second.owned(tag_for(30))
    second.prune()
    assert second.tags() == [tag_for(200), tag_for(100), tag_for(30), tag_for(20)]  # r2's own two kept
