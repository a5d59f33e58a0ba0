"""The rendered sbatch script: golden files per profile, valid bash, shellcheck clean, quoting that
holds against hostile strings, and no secret ever written."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from toolkit.recipe.resolve import resolve
from toolkit.render.sbatch import RenderError, RunPlacement, render, shell_quote
from toolkit.runs.layout import RunLayout

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO / "tests" / "golden"
REALISTIC = ["llama3-8b-lora-sft", "llama3-70b-qlora", "llama3-8b-dpo", "llama3-8b-full-32gpu"]
CASES = [(recipe, cluster) for recipe in REALISTIC for cluster in ("hyperpod", "coreweave", "oci")]
CASES.append(("tiny-lora-sft", "lab"))
PYTHON = "/opt/ft/venv/bin/python"  # fixed, so golden files do not depend on this machine


def rendered(recipe: str, cluster: str, run_id: str = "golden-run") -> str:
    resolved = resolve(REPO / "recipes" / f"{recipe}.yaml", cluster)
    script = render(resolved, RunPlacement(run_id, f"/shared/ft/runs/{run_id}"), login_python=PYTHON)
    return script.replace(str(REPO), "/checkout")  # recipe-relative data paths name this checkout


@pytest.mark.parametrize("recipe,cluster", CASES)
def test_matches_golden_file(recipe, cluster):
    """Regenerate after an intended change: FT_UPDATE_GOLDEN=1 pytest tests/unit/test_render.py"""
    script = rendered(recipe, cluster)
    golden = GOLDEN / f"{recipe}__{cluster}.sbatch"
    if os.environ.get("FT_UPDATE_GOLDEN") == "1":
        golden.write_text(script)
    assert golden.exists(), f"missing golden file {golden.name}: run with FT_UPDATE_GOLDEN=1"
    assert script == golden.read_text()


@pytest.mark.parametrize("recipe,cluster", CASES)
def test_is_valid_bash_and_shellcheck_clean(recipe, cluster, tmp_path):
    path = tmp_path / "job.sbatch"
    path.write_text(rendered(recipe, cluster))
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
    if shutil.which("shellcheck"):
        result = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout


def test_rendering_is_deterministic():
    assert rendered("llama3-8b-lora-sft", "hyperpod") == rendered("llama3-8b-lora-sft", "hyperpod")


def test_the_compiled_template_is_kept_in_a_private_cache_and_gives_the_same_script(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = rendered("llama3-8b-lora-sft", "hyperpod")
    folder = tmp_path / "cache" / "ft" / "templates"
    (entry,) = folder.iterdir()
    assert (folder.stat().st_mode & 0o777, entry.stat().st_mode & 0o077) == (0o700, 0)
    assert rendered("llama3-8b-lora-sft", "hyperpod") == first  # from the cache: the same bytes
    entry.write_bytes(b"not bytecode")  # a damaged entry is compiled anew, never trusted
    assert rendered("llama3-8b-lora-sft", "hyperpod") == first


# What follows jinja2's magic bytes in an entry, damaged: each raises something else as it is unpickled.
DAMAGED_ENTRIES = {"cut short": b"\x80\x05K",  # UnpicklingError
                   "a number that is none": b"I12x\n.",  # ValueError
                   "a module that is not there": b"cno_such_module_of_ft\nx\n.",  # ModuleNotFoundError
                   "unforeseen": None}  # a test's own error class: what no list of kinds could name


@pytest.mark.parametrize("damage", sorted(DAMAGED_ENTRIES))
def test_a_cache_entry_damaged_past_its_magic_is_compiled_anew(tmp_path, monkeypatch, damage):
    """sbatch.py's blind except around an entry's load: past jinja2's magic bytes an entry is a pickle,
    whose damage raises whatever unpickling raises, or anything at all: the template is compiled
    instead, the same script comes out and a sound entry replaces the damaged one (narrowed to
    OSError, this test fails: checked)."""
    import jinja2.bccache
    from jinja2.bccache import bc_magic

    class Unforeseen(Exception):
        pass

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = rendered("llama3-8b-lora-sft", "hyperpod")
    (entry,) = (tmp_path / "cache" / "ft" / "templates").iterdir()
    sound = entry.read_bytes()
    if DAMAGED_ENTRIES[damage] is None:
        def load_bytecode(bucket, handle):
            raise Unforeseen("an entry broken in a way nobody foresaw")
        monkeypatch.setattr(jinja2.bccache.Bucket, "load_bytecode", load_bytecode)
    else:
        entry.write_bytes(bc_magic + DAMAGED_ENTRIES[damage])
    assert rendered("llama3-8b-lora-sft", "hyperpod") == first
    assert entry.read_bytes() == sound  # compiled, and kept again


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a folder owned by another user")
def test_a_cache_folder_another_user_owns_is_never_used(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    planted = tmp_path / "cache" / "ft" / "templates"
    planted.mkdir(parents=True)
    os.chown(tmp_path / "cache" / "ft", 4242, 4242)
    assert rendered("llama3-8b-lora-sft", "hyperpod") == (GOLDEN / "llama3-8b-lora-sft__hyperpod.sbatch").read_text()
    assert list(planted.iterdir()) == []  # nothing written where another user could swap it


@pytest.mark.skipif(os.geteuid() != 0, reason="plants files as another user")
def test_a_cache_entry_this_user_does_not_own_alone_is_never_loaded(tmp_path, monkeypatch):
    import pickle

    from jinja2.bccache import bc_magic

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = rendered("llama3-8b-lora-sft", "hyperpod")
    (entry,) = (tmp_path / "cache" / "ft" / "templates").iterdir()
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    entry.write_bytes(bc_magic + pickle.dumps(Payload()))  # what a planted entry would hold
    for owner, mode in ((4242, 0o600), (os.getuid(), 0o620)):
        os.chown(entry, owner, owner)
        entry.chmod(mode)
        assert rendered("llama3-8b-lora-sft", "hyperpod") == first
        assert not marker.exists(), "a cache entry another user could write was loaded"


def test_a_cache_that_cannot_be_written_never_fails_a_render(tmp_path, monkeypatch):
    import errno

    import jinja2.bccache

    def quota_exceeded(*args, **kwargs):  # a full home (the tests run as root, whom no mode stops)
        raise OSError(errno.EDQUOT, "Disk quota exceeded")

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(jinja2.bccache.tempfile, "NamedTemporaryFile", quota_exceeded)
    assert rendered("llama3-8b-lora-sft", "hyperpod") == (GOLDEN / "llama3-8b-lora-sft__hyperpod.sbatch").read_text()
    assert list((tmp_path / "cache" / "ft" / "templates").iterdir()) == []


def sbatch_options(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=?(.*)$", script, re.M))


def test_header_asks_slurm_for_what_the_recipe_needs():
    options = sbatch_options(rendered("llama3-8b-full-32gpu", "hyperpod"))
    assert options["nodes"] == "5" and options["ntasks-per-node"] == "1"  # 4 training and a spare
    assert "no-kill" in options  # Slurm takes a failed node out of the job and lets it run on
    assert options["gpus-per-node"] == "8"
    assert options["time"] == "2-00:00:00"
    assert options["partition"] == "urgent"  # tier premium on hyperpod
    assert "requeue" in options
    assert options["signal"] == "B:USR2@300"  # to the batch shell, not USR1; checkpoint.before_time_limit
    assert options["output"] == "/shared/ft/runs/golden-run/logs/slurm-%j.out"


def test_profile_specifics_reach_the_script():
    hyperpod = rendered("llama3-8b-lora-sft", "hyperpod")
    assert "--auto-resume=1" in hyperpod and "export FI_PROVIDER=efa" in hyperpod
    coreweave = rendered("llama3-8b-lora-sft", "coreweave")
    assert "--container-image=" in coreweave and "--auto-resume" not in coreweave
    oci = rendered("llama3-8b-lora-sft", "oci")
    assert "export NCCL_IB_GID_INDEX=3" in oci
    assert "export NCCL_IB_HCA='=mlx5_0," in oci


HOSTILE = [
    "it's \"quoted\"",
    "two words; echo INJECTED",
    "$(touch {marker})",
    "`touch {marker}`",
    "line one\nline two\n$(touch {marker})",
    "${{HOME}} and $HOME",
    "back\\slash and * glob ?",
    "",
]


def hostile_recipe(tmp_path: Path, marker: Path) -> Path:
    env = {f"HOSTILE_TEST_{i}": value.format(marker=marker) for i, value in enumerate(HOSTILE)}
    recipe = yaml.safe_load((REPO / "recipes" / "tiny-lora-sft.yaml").read_text())
    recipe["env"] = env
    # (a newline in a data path is refused by the schema: tested in test_yaml_hardening.py)
    recipe["data"]["train"] = f"/data/it's a \"path\"; $(touch {marker}) `touch {marker}`.jsonl"
    recipe["model"]["base"] = "/models/o'neil $(touch {marker})".replace("{marker}", str(marker))
    path = tmp_path / "hostile.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_hostile_strings_reach_the_job_exactly_and_never_execute(tmp_path):
    """Run the script's environment section in bash: every value arrives byte for byte, no payload runs."""
    marker = tmp_path / "pwned"
    resolved = resolve(hostile_recipe(tmp_path, marker), "lab")
    script = render(resolved, RunPlacement("hostile", str(tmp_path / "run")), login_python=PYTHON)
    # Everything up to the job's start: run dir, recipe heredoc, exports. Then print the environment.
    head = script.split("\nexec ")[0]
    probe = tmp_path / "probe.sh"
    probe.write_text(head + '\nenv -0 > "$FT_RUN_DIR/env.bin"\n')
    result = subprocess.run(["bash", str(probe)], capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert result.returncode == 0, result.stderr
    assert not marker.exists(), "a payload in the recipe was executed"
    seen = dict(item.split("=", 1) for item in (tmp_path / "run" / "env.bin").read_text().split("\0") if "=" in item)
    for name, value in resolved.recipe.env.items():
        assert seen[name] == value
    carried = RunLayout(tmp_path / "run").read_spec()  # what the job's processes read: typed
    assert carried.recipe == resolved.recipe
    assert carried.derived == resolved.derived


def test_no_secret_value_is_ever_written(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "wandb-secret-0123456789")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret-abcdefghij")
    script = rendered("llama3-8b-lora-sft", "hyperpod")
    assert "wandb-secret-0123456789" not in script and "aws-secret-abcdefghij" not in script
    assert "WANDB_API_KEY" in script  # named, so readers know where it comes from


def test_run_dir_an_sbatch_line_cannot_carry_is_refused(tmp_path):
    resolved = resolve(REPO / "recipes" / "tiny-lora-sft.yaml", "lab")
    with pytest.raises(RenderError, match="cannot carry"):
        render(resolved, RunPlacement("r1", "/shared/my runs/r1"))


@pytest.mark.parametrize("value,expected", [("plain-value_1.2", "plain-value_1.2"), ("", "''"),
                                            ("=mlx5_0", "'=mlx5_0'"), ("a'b", "'a'\"'\"'b'")])
def test_shell_quote(value, expected):
    assert shell_quote(value) == expected
    assert subprocess.run(["bash", "-c", f"printf %s {shell_quote(value)}"], capture_output=True,
                          text=True).stdout == value


def test_old_slurm_gets_gres_instead_of_gpus_per_node():
    resolved = resolve(REPO / "recipes" / "llama3-8b-lora-sft.yaml", "oci")
    placement = RunPlacement("r", "/shared/r")
    old = sbatch_options(render(resolved, placement, login_python=PYTHON, slurm_version=(18, 8, 9)))
    new = sbatch_options(render(resolved, placement, login_python=PYTHON, slurm_version=(22, 5, 8)))
    assert old["gres"] == "gpu:8" and "gpus-per-node" not in old
    assert new["gpus-per-node"] == "8" and "gres" not in new


def test_a_job_asks_its_share_of_each_nodes_cores_and_memory():
    """One task per node (the launcher) asks for its GPUs' share of the node's cores and memory,
    never less than a core per rank and one for the launcher; a site that gives nodes whole gets
    --exclusive. The training step is told its cores (srun's inheritance differs by version)."""
    from toolkit.render.node_request import node_request

    lab = resolve(REPO / "recipes" / "tiny-lora-sft.yaml", "lab")  # 1 of 4 GPUs of a 4-core, 16 GB node
    assert node_request(lab) == node_request(lab).__class__(False, 2, 4096, 2)
    script = render(lab, RunPlacement("r1", "/shared/runs/r1"), login_python="/usr/bin/python3")
    assert "#SBATCH --cpus-per-task=2\n#SBATCH --mem=4096M\n" in script and "--exclusive" not in script
    # The step is told the job's cores, as the #SBATCH line says (a power user's edit carries).
    assert '"whole_nodes": false' in script
    lab.profile = lab.profile.model_copy(update={"cpus_per_node": 64, "memory_per_node_mb": None})
    lab.recipe.resources.gpus_per_node = 2
    request = node_request(lab)  # 2 of 4 GPUs
    assert (request.cpus, request.memory_mb) == (32, None) and "memory_per_node_mb" in request.warnings[0]
    lab.profile = lab.profile.model_copy(update={"cpus_per_node": 1})
    assert "never start" in node_request(lab).warnings[0]
    lab.recipe.resources.gpus_per_node = 4  # every GPU of the node: the whole node, whatever sinfo says
    assert node_request(lab).exclusive
    whole = resolve(REPO / "recipes" / "llama3-8b-lora-sft.yaml", "hyperpod")
    assert node_request(whole).exclusive
    script = render(whole, RunPlacement("r1", "/fsx/ft/runs/r1"), login_python="/usr/bin/python3")
    assert "#SBATCH --exclusive\n#SBATCH --mem=0\n" in script and '"whole_nodes": true' in script
