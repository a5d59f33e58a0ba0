"""The object store's tier and the mirror, against a real S3 server (SeaweedFS on loopback): a
checkpoint is taken only whole and verified, an unfinished multipart upload is aborted, a store that
is down costs training nothing and the mirror catches up when it is back."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from tests.support.s3 import filesystem, s3_server
from tests.unit.test_checkpoint_shared import LINEAGE, write_checkpoint
from toolkit.checkpoint import manifest
from toolkit.checkpoint.mirror import Mirror
from toolkit.checkpoint.remote import RemoteProblem, RemoteTier, mirror_url
from toolkit.checkpoint.shared import SharedTier
from toolkit.checkpoint.status import StatusBoard, summary_line

pytest.importorskip("s3fs")
BUCKET = "ckpt"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("s3")) as server:
        fs = filesystem(server.env)
        fs.mkdir(BUCKET)
        yield fs


@pytest.fixture
def remote(store) -> RemoteTier:
    return RemoteTier(f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}/checkpoints", keep_last=2, filesystem=store)


def published(tier: SharedTier, step: int, payload: bytes = b"weights" * 1000) -> manifest.Manifest:
    write_checkpoint(tier, step, payload)
    return manifest.read(tier.root / manifest.tag_for(step))


def test_upload_then_download_gives_the_same_verified_checkpoint(tmp_path, remote):
    shared = SharedTier(tmp_path / "shared", keep_last=3)
    described = published(shared, 10, payload=bytes(range(256)) * 40_000)  # 10 MB: a multipart upload
    remote.upload(shared.root / "step-00000010", described)
    assert remote.tags() == ["step-00000010"]
    assert remote.manifest("step-00000010") == described
    landing = tmp_path / "landing"
    assert remote.download("step-00000010", landing, LINEAGE) == described
    assert manifest.verify(landing, LINEAGE) is None
    assert (landing / "model.pt").read_bytes() == (shared.root / "step-00000010" / "model.pt").read_bytes()


def test_an_upload_without_its_manifest_is_not_a_checkpoint(tmp_path, remote, store):
    shared = SharedTier(tmp_path, keep_last=3)
    described = published(shared, 10)
    remote.upload(shared.root / "step-00000010", described)
    partial = published(shared, 20)
    with pytest.raises(InterruptedError):  # abandoned after its first file: no manifest goes up
        calls = iter([True, False])
        remote.upload(shared.root / "step-00000020", partial, keep_going=lambda: next(calls))
    assert store.exists(remote._path("step-00000020", "model.pt"))
    assert remote.tags() == ["step-00000010"]


def test_a_corrupt_object_is_caught_and_nothing_of_it_is_kept(tmp_path, remote, store):
    shared = SharedTier(tmp_path / "shared", keep_last=3)
    remote.upload(shared.root / "step-00000010", published(shared, 10))
    key = remote._path("step-00000010", "model.pt")
    data = bytearray(store.cat_file(key))
    data[3] ^= 0xFF
    store.pipe_file(key, bytes(data))
    landing = tmp_path / "landing"
    with pytest.raises(RemoteProblem, match="model.pt does not match its sha256"):
        remote.download("step-00000010", landing, LINEAGE)
    assert not landing.exists()


def test_a_manifest_in_the_store_cannot_write_outside_the_landing_folder(tmp_path, remote, store):
    bad = {"step": 10, "lineage": LINEAGE, "files": {"../../escaped": {"bytes": 1, "sha256": "a" * 64}}}
    store.pipe_file(remote._path("step-00000010", "manifest.json"), json.dumps(bad).encode())
    with pytest.raises(RemoteProblem, match="unsafe path"):
        remote.download("step-00000010", tmp_path / "landing", LINEAGE)
    assert not (tmp_path / "escaped").exists() and not (tmp_path.parent / "escaped").exists()


def test_prune_keeps_the_newest_and_drops_old_partial_uploads(tmp_path, remote, store):
    shared = SharedTier(tmp_path, keep_last=5)
    store.pipe_file(remote._path("step-00000005", "model.pt"), b"left by a killed job")  # no manifest
    for step in (10, 20, 30):
        remote.upload(shared.root / manifest.tag_for(step), published(shared, step))
    remote.prune()
    assert remote.tags() == ["step-00000030", "step-00000020"]
    store.invalidate_cache()
    left = store.find(remote._path())
    assert left and not [key for key in left if "step-00000005" in key or "step-00000010" in key], left


def test_unfinished_multipart_uploads_of_the_prefix_are_aborted(remote, store):
    bucket, _, prefix = remote.url.removeprefix("s3://").partition("/")
    store.call_s3("create_multipart_upload", Bucket=bucket, Key=f"{prefix}/step-00000010/model.pt")
    other = store.call_s3("create_multipart_upload", Bucket=bucket, Key="another-run/step-00000010/model.pt")
    assert remote.abort_unfinished() == 1
    left = store.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])
    assert [upload["Key"] for upload in left] == ["another-run/step-00000010/model.pt"]
    store.call_s3("abort_multipart_upload", Bucket=bucket, Key=other["Key"], UploadId=other["UploadId"])


def test_the_mirror_uploads_in_the_background_and_reports_where_each_tier_is(tmp_path, remote):
    shared = SharedTier(tmp_path / "shared", keep_last=3)
    board = StatusBoard(tmp_path / "checkpoints.json", remote.url)
    logged: list[str] = []
    mirror = Mirror(remote, shared, board, logged.append)
    mirror.start(None)
    for step in (10, 20):
        described = published(shared, step)
        board.published(step)
        mirror.offer(described)
    assert mirror.drain(60)
    assert remote.tags()[0] == "step-00000020"
    state = json.loads((tmp_path / "checkpoints.json").read_text())
    assert state["shared"]["step"] == 20 and state["remote"]["step"] == 20 and state["remote"]["error"] is None
    assert summary_line(state) == f"step 20 on the shared filesystem; step 20 in {remote.url}"
    assert mirror.close(5)
    assert any("mirrored to" in line and "MB/s" in line for line in logged)


class Held:
    """A filesystem whose every call waits until `released` is set: a store that answers nothing."""

    def __init__(self, target):
        self.target, self.released = target, threading.Event()

    def __getattr__(self, name):
        found = getattr(self.target, name)
        if not callable(found):
            return found

        def held(*args, **kwargs):
            self.released.wait()
            return found(*args, **kwargs)

        return held


def test_a_store_that_is_down_costs_training_nothing_and_the_mirror_catches_up(tmp_path, remote, store):
    import s3fs

    shared = SharedTier(tmp_path / "shared", keep_last=3)
    board = StatusBoard(tmp_path / "checkpoints.json", remote.url)
    live = remote.filesystem
    # Nothing listens on the discard port: every request fails, as with a store that is down.
    remote.filesystem = s3fs.S3FileSystem(endpoint_url="http://127.0.0.1:9", key="k", secret="s",
                                          skip_instance_cache=True, config_kwargs={"retries": {"max_attempts": 1}})
    held = Held(remote.filesystem)  # every call to the store waits until released
    remote.filesystem = held
    logged: list[str] = []
    mirror = Mirror(remote, shared, board, logged.append, max_backoff=0.5)
    mirror.start(None)
    offering = threading.Thread(target=lambda: (board.published(10), mirror.offer(published(shared, 10))), daemon=True)
    offering.start()
    offering.join(timeout=30)
    assert not offering.is_alive()  # offered while the store answers nothing: offering never waits for it
    held.released.set()
    assert not mirror.drain(30)  # gives up at the first failed attempt
    state = json.loads((tmp_path / "checkpoints.json").read_text())
    assert state["remote"]["step"] is None and state["remote"]["pending"] == 10 and state["remote"]["error"]
    assert "failing for" in summary_line(state) and "retrying" in summary_line(state)
    board.published(20)
    mirror.offer(published(shared, 20))  # a newer one while the store is down: the one worth uploading
    remote.filesystem = live  # the store is back
    deadline = time.monotonic() + 60
    while remote.tags()[:1] != ["step-00000020"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert remote.tags() == ["step-00000020"]
    assert mirror.drain(30) and mirror.close(5)
    assert json.loads((tmp_path / "checkpoints.json").read_text())["remote"]["error"] is None
    assert any("failed" in line and "retrying in" in line for line in logged)


def test_a_resume_whose_fetch_from_the_store_fails_unforeseen_takes_the_shared_copy(tmp_path, remote, monkeypatch):
    """checkpoint.py's blind except in _choose: the store's fetch of a newer checkpoint failing in a way
    nobody foresaw (not a RemoteProblem, nor an OSError) is warned of, the tag is skipped and the
    newest checkpoint of the shared filesystem resumed, never the run failed (narrowed to OSError, this
    test fails: checked)."""
    from toolkit.train.checkpoint import Checkpointer, Tiers

    class Unforeseen(Exception):
        pass

    def download(*args, **kwargs):
        raise Unforeseen("the store broke in a way nobody foresaw")

    elsewhere = SharedTier(tmp_path / "elsewhere", keep_last=3)
    remote.upload(elsewhere.root / "step-00000020", published(elsewhere, 20))
    shared = SharedTier(tmp_path / "shared", keep_last=3)
    published(shared, 10)
    monkeypatch.setattr(remote, "download", download)
    chooser = Checkpointer.__new__(Checkpointer)  # _choose needs its tiers, lineage and log alone
    warnings: list[str] = []
    chooser.tiers, chooser.lineage, chooser.log = Tiers(shared, remote), LINEAGE, warnings.append
    assert chooser._choose() == ("step-00000010", str(shared))
    assert any("could not fetch checkpoint step-00000020" in line and "Unforeseen: the store broke" in line
               for line in warnings), warnings
    assert not (shared.root / "step-00000020").exists()


def test_the_mirror_of_a_run_is_under_the_users_own_place():
    import getpass

    assert mirror_url("s3://bucket/mine/", "s3://site/ft", "run-1") == "s3://bucket/mine"
    assert mirror_url(None, "s3://site/ft/", "run-1") == f"s3://site/ft/users/{getpass.getuser()}/runs/run-1/checkpoints"
    assert mirror_url(None, "", "run-1") is None


def test_the_status_of_a_run_that_ended_with_an_upload_abandoned_says_so_and_stops_counting(tmp_path):
    board = StatusBoard(tmp_path / "checkpoints.json", "s3://bucket/run")
    board.published(20)
    board.pending(20)
    board.mirrored(20)
    state = json.loads((tmp_path / "checkpoints.json").read_text())
    assert state["remote"]["pending"] is None  # nothing in flight once it is up
    board.published(40)
    board.pending(40)
    board.failed("NoCredentialsError: Unable to locate credentials")
    assert "retrying" in summary_line(json.loads((tmp_path / "checkpoints.json").read_text()))
    board.gave_up(40)
    line = summary_line(json.loads((tmp_path / "checkpoints.json").read_text()), now=time.time() + 3600)
    assert "step 40 was not uploaded when the job ended: NoCredentialsError" in line
    assert "retrying" not in line and "failing for" not in line and "uploading" not in line


def test_submit_warns_when_the_mirror_will_find_no_credentials(tmp_path, monkeypatch):
    from tests.support.training import TINY
    from toolkit.recipe.resolve import resolve
    from toolkit.submission import mirror_warnings

    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws
    for name in ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    resolved = resolve(TINY, "lab")
    (warning,) = mirror_warnings(resolved, "run-1")
    own = f"s3://ft-checkpoints/users/{__import__('getpass').getuser()}"
    assert f"{own}/runs/run-1/checkpoints" in warning and 'eval "$(ft lab env)"' in warning
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "lab-key")
    assert mirror_warnings(resolved, "run-1") == []


def test_a_new_start_keeps_the_steps_an_earlier_one_recorded(tmp_path):
    """A requeued job's first writes of the status must not say "no checkpoint" of a run that has
    some: `ft status` shows it, and the job script counts node losses in a row by that step."""
    path = tmp_path / "checkpoints.json"
    earlier = StatusBoard(path, "s3://bucket/run")
    earlier.published(40)
    earlier.mirrored(30)
    later = StatusBoard(path, "s3://bucket/run")
    later.failed("the store is down")  # a write before this start's first save
    state = json.loads(path.read_text())
    assert state["shared"]["step"] == 40 and state["remote"]["step"] == 30
    elsewhere = StatusBoard(path, "s3://another/place")  # a mirror moved: its step is not this one's
    elsewhere.failed("down")
    assert json.loads(path.read_text())["remote"]["step"] is None
    path.write_text('{"shared": {"step": "40; rm -rf /"}}')  # torn or forged: carried over as nothing
    StatusBoard(path, None).published(50)
    assert json.loads(path.read_text())["shared"]["step"] == 50


def test_the_upload_lag_counts_from_the_oldest_checkpoint_the_mirror_lacks(tmp_path, monkeypatch):
    """Saves every few minutes while uploads fail must not reset the lag (the alert would never
    fire): it counts from the first shared checkpoint not mirrored, across a requeue too."""
    from toolkit.checkpoint import status as status_module

    clock = iter([100.0, 200.0, 300.0, 400.0, 500.0, 600.0, 700.0])
    monkeypatch.setattr(status_module.time, "time", lambda: next(clock))
    path = tmp_path / "checkpoints.json"
    board = StatusBoard(path, "s3://bucket/run")
    board.published(10)  # 100
    board.mirrored(10)  # 200: caught up
    assert json.loads(path.read_text())["remote"]["behind_since"] is None
    board.published(20)  # 300: behind from here
    board.published(30)  # 400
    assert json.loads(path.read_text())["remote"]["behind_since"] == 300.0
    board.mirrored(20)  # 500: still lacks 30, published at 400
    assert json.loads(path.read_text())["remote"]["behind_since"] == 400.0
    later = StatusBoard(path, "s3://bucket/run")  # the job requeued before 30 was uploaded
    later.failed("down")  # 600
    assert json.loads(path.read_text())["remote"]["behind_since"] == 400.0
