"""A researcher without root on a cluster she does not run: ftlab-carol (made by `ft lab up`, with her
Slurm association) goes from a clean home directory to a completed run with the README's own lines
(the block between its `lab-user-path` markers), then `ft doctor` names each broken setup with its fix.

Her pip never leaves the machine: it reads a wheelhouse the test gathers first (as root, the way
scripts/setup.sh installs ft: the package index), through pip's own PIP_NO_INDEX/PIP_FIND_LINKS,
as a site with a local mirror would set them. It holds deepspeed as its source package, so her pip
(Debian's, upgraded by install-user.sh) builds it as it would from the index. Everything else is
real: her own venvs, a real Slurm job building the training environment on a compute node, a real
2-node run, real preflight steps."""

from __future__ import annotations

import json
import pwd
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CAROL = "ftlab-carol"

pytestmark = pytest.mark.slow


def readme_lines() -> str:
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- lab-user-path -->\n```bash\n(.*?)```\n<!-- /lab-user-path -->", text, re.S)
    assert block, "README.md lost its lab-user-path block"
    return block.group(1)


@pytest.fixture(scope="module")
def wheelhouse(lab) -> Path:
    """Every wheel ft[train] needs, and ft's build backend, gathered as root through the index
    (begun with the lab session when this module is in it: tests/support/wheelhouse.py)."""
    from tests.support.wheelhouse import folder_of, gathered

    return gathered(folder_of(lab.shared_dir))


def site_profile(lab) -> dict[str, str]:
    """Her login's site profile is the test's lab slice's (the first slice's is the default)."""
    return {"FT_SITE_PROFILE": lab.slices[0].profile} if lab.slices else {}


def checkout_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    return [name for name in listed.split("\0") if name and (REPO / name).is_file()]


@pytest.fixture(scope="module")
def carol(lab, wheelhouse) -> dict:
    """Carol with a clean home holding only a clone of ft (this checkout's files), and nothing of
    hers left on the shared filesystem from an earlier run."""
    if CAROL not in lab.users:
        pytest.fail(f"the lab has no account {CAROL}: bring it up again with `ft lab up`")
    account = pwd.getpwnam(CAROL)
    home = Path(account.pw_dir)
    subprocess.run(["scancel", "--user", CAROL], check=False, capture_output=True)
    for entry in home.iterdir():
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    shared = Path(lab.shared_dir)
    for leftover in ("envs", "cache"):
        shutil.rmtree(shared / leftover / f"uid-{account.pw_uid}", ignore_errors=True)
    clone = home / "ft"
    for name in checkout_files():
        (clone / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, clone / name)
    subprocess.run(["chown", "-R", f"{CAROL}:{CAROL}", str(home)], check=True)
    env = {"HOME": str(home), "USER": CAROL, "LOGNAME": CAROL, "LANG": "C.UTF-8", "SHELL": "/bin/bash",
           "PATH": "/usr/local/bin:/usr/bin:/bin", "SLURM_CONF": lab.slurm_conf, "HF_HUB_OFFLINE": "1",
           "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheelhouse), **site_profile(lab)}
    return {"home": home, "clone": clone, "uid": account.pw_uid, "env": env}


def as_carol(carol: dict, script: str, timeout: float = 900) -> subprocess.CompletedProcess:
    runuser = shutil.which("runuser") or "/usr/sbin/runuser"  # her PATH has no sbin
    return subprocess.run([runuser, "-u", CAROL, "--", "bash", "-euo", "pipefail", "-c", script],
                          capture_output=True, text=True, timeout=timeout, env=carol["env"], cwd=carol["clone"])


LOGIN = 'export PATH="$HOME/.local/bin:$PATH"; eval "$(ft lab env)"; '


@pytest.fixture(scope="module")
def user_path(carol) -> subprocess.CompletedProcess:
    done = as_carol(carol, readme_lines())
    assert done.returncode == 0, f"the README's lines failed as {CAROL}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


def test_readme_lines_take_a_clean_home_to_a_completed_run(user_path, carol):
    assert "COMPLETED" in user_path.stdout and "ready" in user_path.stdout
    runs = json.loads(as_carol(carol, LOGIN + "ft ls --cluster mylab --json").stdout)
    run_dir = Path(runs[0]["run_dir"])
    assert runs[0]["state"] == "COMPLETED" and (run_dir / "output" / "adapter_model.safetensors").is_file()
    profile = json.loads(as_carol(carol, LOGIN + "ft cluster show mylab --json").stdout)
    assert profile["environment"] == "venv"
    assert profile["python"].startswith(f"/var/lib/ft-lab/shared/envs/uid-{carol['uid']}/mylab/ft-")
    # The job ran the prepared environment's interpreter, not the login install's.
    script = (run_dir / "job.sbatch").read_text()
    spec = json.loads((run_dir / "recipe.json").read_text())
    assert spec["step"]["python"] == profile["python"] and ".local/share/ft" not in script  # the ranks'
    assert script.rstrip().endswith(f"exec {profile['python']} -m toolkit.job")  # and the job's own
    assert {"free", "standard", "premium"} == set(profile["tiers"]) and profile["default_account"] == "research"


def test_the_login_install_has_no_training_stack_and_nothing_is_roots(user_path, carol):
    venv_python = carol["home"] / ".local" / "share" / "ft" / "venv" / "bin" / "python"
    found = as_carol(carol, f"{venv_python} -c 'import importlib.util as u; "
                            "print([m for m in (\"torch\", \"deepspeed\", \"transformers\") if u.find_spec(m)])'")
    assert found.stdout.strip() == "[]", found.stderr
    foreign = [path for path in carol["home"].rglob("*")
               if not path.is_symlink() and path.lstat().st_uid != carol["uid"]]
    assert foreign == []


def test_the_login_install_reads_data_from_the_object_store(user_path, carol, lab):
    """scripts/install-user.sh brings s3fs: the data gate reads s3:// data on the login node."""
    import fsspec

    exports = subprocess.run([str(REPO / ".venv" / "bin" / "ft"), "lab", "env"], capture_output=True, text=True,
                             check=True).stdout
    env = dict(line.removeprefix("export ").split("=", 1) for line in exports.splitlines())
    store = fsspec.filesystem("s3", key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
                              client_kwargs={"endpoint_url": env["AWS_ENDPOINT_URL"]})
    url = f"ft-models/tests/carol-{carol['uid']}/tiny-sft.jsonl"
    store.pipe_file(url, (REPO / "recipes" / "data" / "tiny-sft.jsonl").read_bytes())
    try:
        checked = as_carol(carol, LOGIN + f"ft data check s3://{url} --tokenizer tiny-llama --json")
        assert checked.returncode == 0, checked.stderr[-2000:]
        [report] = json.loads(checked.stdout)
        assert report["ok"] and report["valid_rows"] == 256 and report["path"] == f"s3://{url}"
    finally:
        store.rm(url)


def test_submit_before_the_training_environment_is_refused_naming_the_fix(user_path, carol):
    done = as_carol(carol, LOGIN + "ft cluster add early --extends lab --yes --force >/dev/null && "
                           "ft submit ~/ft/recipes/tiny-lora-sft.yaml --cluster early")
    assert done.returncode != 0 and "ft cluster prepare early" in done.stderr and "Traceback" not in done.stderr
    queued = subprocess.run(["squeue", "--noheader", "--user", CAROL], capture_output=True, text=True)
    assert queued.stdout.strip() == ""  # no job was queued


def doctor(carol: dict, cluster: str, *options: str) -> tuple[int, list[dict]]:
    done = as_carol(carol, LOGIN + f"ft doctor --cluster {cluster} --json " + " ".join(options), timeout=300)
    report = json.loads(done.stdout)
    return done.returncode, [f for f in report["findings"] if f["level"] == "blocker"]


def broken_copy(carol: dict, name: str, *changes: str) -> None:
    done = as_carol(carol, LOGIN + f"ft cluster add {name} --extends mylab --yes --force >/dev/null && "
                           f"ft cluster set {name} " + " ".join(changes))
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(("changes", "check", "detail", "fix"), [
    (["tiers.standard.partition=gpu"], "partition", "partition 'gpu' does not exist", "tiers.standard.partition="),
    (["shared_root=/var/lib/ft-lab"], "shared_root", "/var/lib/ft-lab is not writable by you",
     "ft cluster set broken shared_root="),
    (["default_account=physics"], "account", "no association with Slurm account 'physics'",
     "default_account=research"),
])
def test_doctor_names_a_broken_login_side_setup(user_path, carol, changes, check, detail, fix):
    broken_copy(carol, "broken", *changes)
    code, blockers = doctor(carol, "broken", "--login-only")
    assert code == 1 and [b["check"] for b in blockers] == [check], blockers
    assert detail in blockers[0]["detail"] and fix in blockers[0]["fix"]


def test_doctor_names_a_compute_node_without_the_training_stack(user_path, carol):
    broken_copy(carol, "bare", "environment=", "python=/usr/bin/python3")
    code, blockers = doctor(carol, "bare", "--nodes", "1")
    assert code == 1 and [b["check"] for b in blockers] == ["environment"], blockers
    assert "ft does not import with /usr/bin/python3 on the compute nodes" in blockers[0]["detail"]
    assert blockers[0]["where"].startswith("node") and blockers[0]["fix"] == "ft cluster prepare bare"


def test_doctor_names_a_version_mismatch_between_login_and_compute_nodes(user_path, carol):
    init = carol["clone"] / "toolkit" / "__init__.py"
    original = init.read_text()
    try:
        assert as_carol(carol, "echo '# a local edit after ft cluster prepare' >> toolkit/__init__.py").returncode == 0
        code, blockers = doctor(carol, "mylab", "--nodes", "1")
    finally:
        init.write_text(original)
    assert code == 1 and {b["check"] for b in blockers} == {"environment", "ft_version"}, blockers
    compute = next(b for b in blockers if b["check"] == "ft_version")
    assert compute["where"].startswith("node") and "on compute nodes" in compute["detail"]
    assert all(b["fix"] == "ft cluster prepare mylab" for b in blockers)
    assert doctor(carol, "mylab", "--nodes", "1")[0] == 0  # the edit undone: the same ft again


@pytest.mark.slurm_matrix
def test_doctor_names_the_wrong_account_from_slurms_own_refusal(user_path, carol):
    broken_copy(carol, "wrong-account", "default_account=physics")
    code, blockers = doctor(carol, "wrong-account", "--nodes", "1")
    assert code == 1 and {b["check"] for b in blockers} == {"account"}, blockers
    assert any("Slurm refused the preflight step" in b["detail"] for b in blockers)  # sbatch/srun refuse it too


@pytest.mark.slurm_matrix
def test_cluster_add_asks_only_for_what_it_could_not_discover(user_path, carol):
    """At a terminal (script(1) gives it one), the one question is the shared folder: Slurm told the
    rest. The answer is typed at the prompt."""
    done = as_carol(carol, LOGIN + "printf '/var/lib/ft-lab/shared\\n' | "
                           "script -qec 'ft cluster add asked --cpu-workers-per-node 1 --force' /dev/null")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("Shared filesystem folder") == 1 and "Slurm account" not in done.stdout
    profile = json.loads(as_carol(carol, LOGIN + "ft cluster show asked --json").stdout)
    assert profile["shared_root"] == "/var/lib/ft-lab/shared" and profile["default_account"] == "research"
