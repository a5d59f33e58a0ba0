"""Two real accounts on the lab (ftlab-alice, ftlab-bob, made by `ft lab up`), through ft as each
would use it: bob can neither read alice's run nor put code or data in her job. Before alice's first
run, bob makes the folders ft would keep her files in (their names are predictable) and fills them,
and a checkpoint is planted in her mirror by an identity that may write there (a site's one shared
instance role); her run completes without reading any of it, and says why. In the object store each
account has its own identity, scoped to its own checkpoints."""

from __future__ import annotations

import json
import os
import pwd
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.support.s3 import filesystem
from tests.support.slurm import wait_for
from tests.support.training import tiny_recipe
from toolkit.checkpoint import manifest
from toolkit.checkpoint.remote import RemoteTier

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny-lora-sft.yaml"
ALICE, BOB = "ftlab-alice", "ftlab-bob"

pytest.importorskip("deepspeed", reason="the training stack (ft[train]) is not installed")


def as_user(user: str, *argv: str, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    account = pwd.getpwnam(user)
    env = {"PATH": os.environ["PATH"], "HOME": account.pw_dir, "USER": user, "LOGNAME": user, "LANG": "C.UTF-8",
           "AWS_ENDPOINT_URL": os.environ.get("AWS_ENDPOINT_URL", "http://127.0.0.1:8333"), "HF_HUB_OFFLINE": "1",
           **({"FT_SITE_PROFILE": os.environ["FT_SITE_PROFILE"]} if "FT_SITE_PROFILE" in os.environ else {}),
           **(env or {})}
    return subprocess.run(["runuser", "-u", user, "--", *argv], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=REPO)


USERS_PYTHON: list[str] = []  # set by the accounts fixture


def ft_as(user: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return as_user(user, *USERS_PYTHON, "-m", "toolkit", *args, env=env)


def lab_env(user: str) -> dict[str, str]:
    """What `eval "$(ft lab env)"` gives the user's shell."""
    printed = ft_as(user, "lab", "env")
    assert printed.returncode == 0, printed.stderr
    return dict(shlex.split(line.removeprefix("export "))[0].split("=", 1) for line in printed.stdout.splitlines())


def users_python(folder: Path) -> Path:
    """A Python environment other accounts may run: this checkout's venv may sit on a private
    interpreter (pyenv under /root), so the system's Python of the same version is given the venv's
    packages and the checkout by a .pth file, as a cluster's shared environment would be."""
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    if not system.exists():
        pytest.skip(f"no {system} to run ft as another account")
    shutil.rmtree(folder, ignore_errors=True)
    subprocess.run([str(system), "-m", "venv", "--without-pip", str(folder)], check=True)
    site = next(Path(sys.prefix).glob("lib/python*/site-packages"))
    (next(folder.glob("lib/python*/site-packages")) / "ft-checkout.pth").write_text(f"{site}\n{REPO}\n")
    subprocess.run(["chmod", "-R", "a+rX", str(folder)], check=True)
    return folder / "bin" / "python"


@pytest.fixture(scope="module")
def accounts(lab):
    if ALICE not in lab.users or BOB not in lab.users:
        pytest.fail(f"the lab has no accounts {ALICE} and {BOB}: bring it up again with `ft lab up`")
    folder = Path(lab.shared_dir) / "tests" / f"users-python-{os.getpid()}"
    USERS_PYTHON[:] = [str(users_python(folder))]
    reachable = as_user(ALICE, *USERS_PYTHON, "-c", "import toolkit, deepspeed")
    if reachable.returncode != 0:
        said = (reachable.stderr.strip().splitlines() or ["no output"])[-1]
        pytest.skip(f"this checkout ({REPO}) cannot be read by other accounts (a folder above it is private: "
                    f"clone where others may read, as a cluster's shared install is): {said}")
    yield {name: pwd.getpwnam(name) for name in (ALICE, BOB)}
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def squatted(lab, accounts):
    """What bob makes, under the names ft would use for alice, before she ever runs ft."""
    alice = accounts[ALICE].pw_uid
    shared = Path(lab.shared_dir)
    places = {"cache": shared / "cache" / f"uid-{alice}",
              "keys": shared / "runs" / ".keys" / f"uid-{alice}",
              "models": Path(f"/tmp/ft-model-cache-{alice}")}
    for place in places.values():
        shutil.rmtree(place, ignore_errors=True)
    script = ("import os, sys\n"
              "for place in sys.argv[1:]:\n"
              "    os.makedirs(os.path.join(place, 'planted'), exist_ok=True)\n"
              "    os.chmod(place, 0o777)\n"
              "    open(os.path.join(place, 'planted', 'payload.py'), 'w').write('print(1)')\n")
    made = as_user(BOB, *USERS_PYTHON, "-c", script, *map(str, places.values()))
    assert made.returncode == 0, made.stderr
    before = {name: sorted(str(p) for p in place.rglob("*")) for name, place in places.items()}
    yield places, before
    for place in places.values():
        shutil.rmtree(place, ignore_errors=True)


PLANTED = "step-99999999"


@pytest.fixture(scope="module")
def planted_mirror(lab, accounts) -> str:
    """Alice's mirror (under her own place), holding a whole checkpoint at a far newer step than she
    will ever reach, uploaded there by the lab's admin identity: what anyone holding a site's one
    shared instance role could do. Its lineage is empty, as in the review's attack."""
    mirror = f"s3://ft-checkpoints/users/{ALICE}/tests/{uuid.uuid4().hex[:12]}"
    store = filesystem(lab.object_store.env)
    weights = b"bob's weights"
    planted = manifest.Manifest(manifest.step_of(PLANTED), {"mp_rank_00_model_states.pt": manifest.FileEntry(
        len(weights), __import__("hashlib").sha256(weights).hexdigest())}, lineage="")
    base = f"{mirror.removeprefix('s3://')}/{PLANTED}"
    store.pipe_file(f"{base}/mp_rank_00_model_states.pt", weights)
    store.pipe_file(f"{base}/{manifest.MANIFEST}", planted.to_json().encode())
    yield mirror
    store.rm(mirror.removeprefix("s3://"), recursive=True)


@pytest.fixture(scope="module")
def alice_run(lab, squatted, planted_mirror) -> dict:
    folder = Path(lab.shared_dir) / "tests" / f"alice-recipe-{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    document = tiny_recipe()
    document["checkpoint"]["s3_mirror"] = planted_mirror
    path = folder / "tiny-lora-sft.yaml"
    path.write_text(__import__("yaml").safe_dump(document))
    subprocess.run(["chmod", "-R", "a+rX", str(folder)], check=True)
    result = ft_as(ALICE, "submit", "--json", str(path), env=lab_env(ALICE))
    assert result.returncode == 0, result.stdout + result.stderr
    run = json.loads(result.stdout)

    def finished():
        state = json.loads(ft_as(ALICE, "status", run["run_id"], "--json").stdout)["state"]
        return state if state in {"COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"} else None

    state = wait_for(f"alice's run {run['run_id']}", finished, timeout=420, interval=3)
    assert state == "COMPLETED", ft_as(ALICE, "logs", run["run_id"], "--rank", "0").stdout[-3000:]
    yield run
    shutil.rmtree(folder, ignore_errors=True)


def test_alice_run_is_private_to_her(alice_run, accounts):
    run_dir = Path(alice_run["run_dir"])
    info = run_dir.stat()
    assert info.st_uid == accounts[ALICE].pw_uid and info.st_mode & 0o777 == 0o700
    assert (run_dir / "output" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("command", [["status"], ["logs"], ["cancel"]])
def test_bob_cannot_see_or_act_on_alices_run_through_ft(alice_run, command):
    result = ft_as(BOB, *command, alice_run["run_id"])
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" not in output
    assert alice_run["run_id"] in output  # a located error, naming what was asked for


def test_bob_lists_none_of_alices_runs(alice_run):
    result = ft_as(BOB, "ls", "--json")
    assert result.returncode == 0, result.stderr
    assert alice_run["run_id"] not in result.stdout


def test_bob_sees_alices_gpu_hours_from_slurm_but_nothing_of_her_run_folder(alice_run):
    """Slurm's accounting is every user's to read (sacct --allusers); her run's records are not: bob's
    `ft usage` counts her job's allocation and says nothing of its faults."""
    result = ft_as(BOB, "usage", "--json", "--since", "2000-01-01")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    report = json.loads(result.stdout)
    (row,) = [row for row in report["rows"] if row["key"] == alice_run["run_id"]]
    assert row["allocations"] >= 1 and row["refundable_gpu_hours"] is None  # her timeline is hers


@pytest.mark.parametrize("attempt", [
    ["cat", "{run_dir}/run.json"], ["ls", "{run_dir}/logs"], ["cat", "{run_dir}/logs/rank-0.log"],
    ["touch", "{run_dir}/recipe.json"],  # what the workers read when the job is requeued
    ["mkdir", "{run_dir}/checkpoints/planted"],
])
def test_bob_can_neither_read_nor_write_alices_run_folder(alice_run, attempt):
    argv = [part.format(run_dir=alice_run["run_dir"]) for part in attempt]
    result = as_user(BOB, *argv)
    assert result.returncode != 0 and "Permission denied" in result.stderr


def test_alices_job_used_nothing_bob_planted_and_said_why(alice_run, squatted):
    places, before = squatted
    for name, place in places.items():  # nothing added, nothing taken
        assert sorted(str(p) for p in place.rglob("*")) == before[name], name
    rank0 = ft_as(ALICE, "logs", alice_run["run_id"], "--rank", "0").stdout
    assert f"{places['cache']} is a folder of user {BOB}" in rank0
    run_cache = Path(alice_run["run_dir"]) / "cache"
    assert (run_cache / "tokenized").is_dir() and any((run_cache / "models").glob("tiny-llama-*"))


def test_alices_idempotency_key_under_bobs_folder_is_refused_with_nothing_submitted(alice_run, squatted):
    places, _ = squatted
    result = ft_as(ALICE, "submit", "--idempotency-key", "exp-1", str(TINY))
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Traceback" not in output
    assert f"{places['keys']} is a folder of user {BOB}" in output
    queued = subprocess.run(["squeue", "--noheader", "-u", ALICE, "-o", "%i"], capture_output=True, text=True)
    assert queued.stdout.strip() == ""


def test_a_user_without_root_validates_with_a_private_cache_of_their_own(lab, accounts):
    result = ft_as(BOB, "validate", str(TINY))
    assert result.returncode == 0, result.stdout + result.stderr
    cache = Path(lab.shared_dir) / "cache" / f"uid-{accounts[BOB].pw_uid}"
    assert cache.stat().st_uid == accounts[BOB].pw_uid and cache.stat().st_mode & 0o777 == 0o700
    assert any((cache / "tokenized").iterdir())


def test_a_checkpoint_planted_in_alices_mirror_is_never_resumed_from_nor_counted(alice_run, planted_mirror, lab):
    rank0 = ft_as(ALICE, "logs", alice_run["run_id"], "--rank", "0").stdout
    assert f"checkpoint {PLANTED} in the object store ({planted_mirror}) is unusable" in rank0, rank0[-3000:]
    assert "names no lineage" in rank0 and "resumed from checkpoint" not in rank0
    store = filesystem(lab.object_store.env)
    mirror = RemoteTier(planted_mirror, keep_last=2, filesystem=store)  # what the root identity sees there
    assert mirror.tags() == [PLANTED, "step-00000120", "step-00000100"]  # keep_last 2 of hers; not hers to prune
    for tag in mirror.tags()[1:]:  # hers are sealed with her key, which bob cannot read
        sealed = mirror.manifest(tag)
        assert sealed.seal and sealed.lineage
    key = Path(lab.shared_dir) / "keys" / f"uid-{pwd.getpwnam(ALICE).pw_uid}" / "checkpoint-seal.key"
    assert as_user(BOB, "cat", str(key)).returncode != 0


def test_each_account_has_its_own_object_store_identity_scoped_to_its_own_checkpoints(lab, accounts):
    alice_env, bob_env = lab_env(ALICE), lab_env(BOB)
    assert (alice_env["AWS_ACCESS_KEY_ID"], bob_env["AWS_ACCESS_KEY_ID"]) == (ALICE, BOB)
    assert alice_env["AWS_SECRET_ACCESS_KEY"] != bob_env["AWS_SECRET_ACCESS_KEY"]
    stolen = as_user(BOB, "cat", str(Path(lab.object_store.credentials_dir) / f"{ALICE}.json"))
    assert stolen.returncode != 0 and "Permission denied" in stolen.stderr
    alice, bob = filesystem(alice_env), filesystem(bob_env)
    hers = f"ft-checkpoints/users/{ALICE}/tests/{uuid.uuid4().hex[:12]}"
    alice.pipe_file(f"{hers}/step-00000010/manifest.json", b"{}")
    try:
        attempts = {"read": lambda: bob.cat_file(f"{hers}/step-00000010/manifest.json"),
                    "list": lambda: bob.find(f"ft-checkpoints/users/{ALICE}"),
                    "plant": lambda: bob.pipe_file(f"{hers}/{PLANTED}/manifest.json", b"{}"),
                    "delete": lambda: bob.call_s3("delete_object", Bucket="ft-checkpoints",
                                                  Key=f"{hers.split('/', 1)[1]}/step-00000010/manifest.json"),
                    "replace a model": lambda: bob.pipe_file("ft-models/tiny-llama/config.json", b"{}")}
        for name, attempt in attempts.items():
            with pytest.raises(PermissionError):
                attempt()
                pytest.fail(f"bob could {name}")
        bob.pipe_file(f"ft-checkpoints/users/{BOB}/tests/own/x", b"his own place")  # his own place is his
        bob.rm(f"ft-checkpoints/users/{BOB}/tests/own", recursive=True)
        assert alice.cat_file(f"{hers}/step-00000010/manifest.json") == b"{}"
    finally:
        alice.rm(hers, recursive=True)


def test_a_checkpoint_key_folder_taken_by_another_user_refuses_the_submit_with_nothing_queued(lab, accounts):
    """bob's key folder made first by alice (names are predictable): bob's submit says so, and queues
    nothing; his jobs never seal with a key someone else could read."""
    place = Path(lab.shared_dir) / "keys" / f"uid-{accounts[BOB].pw_uid}"
    shutil.rmtree(place, ignore_errors=True)
    made = as_user(ALICE, "mkdir", "-p", "-m", "0777", str(place))
    assert made.returncode == 0, made.stderr
    try:
        result = ft_as(BOB, "submit", str(TINY))
        output = result.stdout + result.stderr
        assert result.returncode != 0 and "Traceback" not in output
        assert f"{place} is a folder of user {ALICE}" in output
        queued = subprocess.run(["squeue", "--noheader", "-u", BOB, "-o", "%i"], capture_output=True, text=True)
        assert queued.stdout.strip() == ""
    finally:
        shutil.rmtree(place, ignore_errors=True)


def test_bob_cannot_push_over_a_model_another_account_pushed_and_nothing_reaches_the_store(lab, accounts):
    """A model pushed by root (an admin) under a name: bob's push of the same name is refused by its
    record before any upload (on a site with one shared role S3 would have taken it; the lab's own
    per-user identities refuse bob the models bucket too)."""
    from tests.support.training import ft
    from toolkit.train.tiny import ensure_tiny_llama

    name = f"lab-tests/owned-{uuid.uuid4().hex[:8]}"
    folder = Path(lab.shared_dir) / "tests" / f"pushed-model-{os.getpid()}"  # where bob may read it too
    model = ensure_tiny_llama(folder)
    pushed = ft("model", "push", str(model), "--name", name, env=lab.object_store.env)
    assert pushed.returncode == 0, pushed.stderr
    entry = name.replace("/", "--")
    store = filesystem(lab.object_store.env)
    before = store.cat_file(f"ft-models/{entry}/manifest.json")
    subprocess.run(["chmod", "-R", "a+rX", str(folder)], check=True)
    try:
        refused = ft_as(BOB, "model", "push", str(model), "--name", name, env=lab_env(BOB))
        output = refused.stdout + refused.stderr
        assert refused.returncode != 0 and "Traceback" not in output
        assert f"model {entry} was pushed by user root" in output
        assert store.cat_file(f"ft-models/{entry}/manifest.json") == before
    finally:
        store.rm(f"ft-models/{entry}", recursive=True)
        (Path(lab.shared_dir) / "model-store" / f"{entry}.json").unlink(missing_ok=True)
        shutil.rmtree(folder, ignore_errors=True)
