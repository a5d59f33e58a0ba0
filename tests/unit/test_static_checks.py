"""Static checks that belong to the test suite: ansible-lint (production profile) and shellcheck."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHELL_SCRIPTS = [
    ".ci/run",
    "ansible/roles/slurm/files/ft-healthcheck",
    *sorted(str(p.relative_to(REPO)) for p in (REPO / "ansible/roles/slurm/files/healthcheck.d").iterdir()),
    *sorted(str(p.relative_to(REPO)) for p in REPO.glob("scripts/*.sh")),
    *sorted(str(p.relative_to(REPO)) for p in REPO.glob("benchmarks/*.sh")),
]


def test_ansible_lint_production_profile_passes():
    lint = Path(sys.executable).with_name("ansible-lint")
    result = subprocess.run([str(lint), "--nocolor", "--profile", "production"], cwd=REPO / "ansible",
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "Profile 'production' was required, and it passed" in result.stderr + result.stdout


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (apt install shellcheck)")
@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_scripts_are_shellcheck_clean(script):
    result = subprocess.run(["shellcheck", "--external-sources", str(REPO / script)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


TOOLKIT = Path(__file__).resolve().parents[2] / "toolkit"
# What runs only in a job (toolkit/LAYERS.md), and the checks a job's nodes run (ft preflight asks
# torch about their GPUs): everything else may run on the login node.
JOB_SIDE = ("train", "launch", "job", "watch")
NODE_CHECKS = Path("doctor/node.py")


def login_side_modules() -> list[Path]:
    return sorted(p for p in TOOLKIT.rglob("*.py")
                  if p.relative_to(TOOLKIT).parts[0] not in JOB_SIDE and p.relative_to(TOOLKIT) != NODE_CHECKS)


TRAINING_STACK = {"torch", "transformers", "deepspeed", "peft", "bitsandbytes", "accelerate"}


def test_no_login_side_module_imports_the_training_side():
    """Every import of every login-side module, at its top or inside a function (which the test
    below, importing them, cannot see): none reaches the training side or its stack."""
    import ast

    offenders = []
    for path in login_side_modules():
        relative = str(path.relative_to(TOOLKIT.parent))
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [(relative, name) for name in names
                          if name.split(".")[:2] in [["toolkit", side] for side in JOB_SIDE]
                          or name.split(".")[0] in TRAINING_STACK]
    assert offenders == []


def test_importing_every_login_side_module_loads_no_training_stack():
    import subprocess
    import sys

    modules = [".".join(p.relative_to(TOOLKIT.parent).with_suffix("").parts).removesuffix(".__init__")
               for p in login_side_modules() if p.name != "__main__.py"]  # those run a command
    probe = ("import importlib, sys\n"
             f"for name in {modules!r}:\n    importlib.import_module(name)\n"
             "print(sorted(m for m in ('torch', 'transformers', 'deepspeed', 'peft', 'bitsandbytes') "
             "if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                            cwd=TOOLKIT.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


def test_run_directory_names_are_spelled_only_by_the_layout():
    """One module owns what a run directory holds (toolkit/runs/layout.py): no other module, and not
    the job script's template, spells a file name of it."""
    import ast

    from toolkit.runs import layout

    names = {layout.RECORD, layout.RECIPE_SOURCE, layout.RECIPE_RESOLVED, layout.SCRIPT, layout.DATA_REPORT,
             layout.SPEC, layout.ATTEMPTS, layout.EVENTS, layout.EXIT_STATUS, layout.METRICS, layout.TRACKING,
             layout.SUMMARY, layout.LAUNCH_FAILURES, layout.RECEIPT,
             layout.RECEIPT_SIGNATURE, layout.CHECKPOINT_STATUS, layout.SRUN_ERRORS, layout.LOST_NODES,
             layout.WARM_SRUN_ERRORS}
    # Names with a job, node or rank in them: neither their start nor their end spelled elsewhere.
    patterns = [layout.SLURM_LOG, layout.NODE_LOG, layout.RANK_LOG, layout.WARM_LOG, layout.SUCCESSOR,
                layout.STACK_DUMP]
    SUFFIXES = {".log", ".out", ".json", ".txt", "."}  # ends that say nothing on their own
    pieces = {piece for pattern in patterns for piece in pattern.split("{")[0:1] + pattern.split("}")[1:] if piece}
    offenders = []
    for path in sorted(TOOLKIT.rglob("*.py")):
        if path.name == "layout.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                      and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                offenders += [(str(path.relative_to(TOOLKIT.parent)), name) for name in names
                              if node.value == name or node.value.endswith("/" + name)]
            if isinstance(node, ast.JoinedStr):  # f"node-{host}.log" and the like
                literal = [part.value for part in node.values if isinstance(part, ast.Constant)]
                offenders += [(str(path.relative_to(TOOLKIT.parent)), piece) for piece in pieces
                              if piece not in SUFFIXES and any(text == piece or text.startswith(piece)
                                                                or text.endswith("/" + piece) for text in literal)]
    template = (TOOLKIT.parent / "sbatch_templates" / "job.sbatch.j2").read_text()
    offenders += [("sbatch_templates/job.sbatch.j2", name) for name in names | pieces
                  if name in template and name not in SUFFIXES]
    assert offenders == []



# Joins onto folders that are not a run's: the lab's provisioning logs, the registry's own layout, a
# checkpoint tier's folder, the run store's root.
OTHER_FOLDERS = {"lab/provision.py", "registry/store.py", "checkpoint/shared.py", "runs/store.py"}


def test_no_module_joins_a_name_onto_a_run_folder_but_the_layout():
    """A name the layout does not know yet is caught too: a literal joined onto a run's folder, its
    logs or a start's marks (`marks / "x.json"`, `run_dir / f"..."`) anywhere but the layout."""
    import re

    join = re.compile(r"\b(marks|logs|run_dir|launch_marks|layout\.[a-z_]+) / f?[\"']")
    offenders = [f"{path.relative_to(TOOLKIT)}:{number}: {line.strip()}"
                 for path in sorted(TOOLKIT.rglob("*.py"))
                 if path.name != "layout.py" and str(path.relative_to(TOOLKIT)) not in OTHER_FOLDERS
                 for number, line in enumerate(path.read_text().splitlines(), 1) if join.search(line)]
    assert offenders == []

SLURM_COMMANDS = {"sacct", "sacctmgr", "salloc", "sattach", "sbatch", "sbcast", "scancel", "scontrol", "sdiag",
                  "sinfo", "sprio", "squeue", "sreport", "srun", "sshare", "sstat", "strigger", "scrontab"}
# What follows a Slurm command's name in a command line (scontrol show job 7, sacctmgr modify qos ...).
SLURM_SUBCOMMANDS = {"show", "update", "requeue", "requeuehold", "listpids", "ping", "reconfigure", "hold",
                     "release", "create", "delete", "modify", "list", "add", "remove", "suspend", "resume"}
# Keys of Slurm's JSON answers (squeue, sacct, sinfo --json) that differ between versions.
SLURM_JSON_KEYS = {"job_state", "state_reason", "tres_req_str", "tres_alloc_str", "batch_host", "user_name",
                   "restart_cnt", "data_parser", "state_flags", "gres_used"}


def non_doc_strings(tree) -> list:
    import ast

    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings]


def test_only_toolkit_slurm_spells_slurm_commands_or_reads_slurms_json():
    """One home for Slurm (toolkit/slurm: a module per concern, the version differences inside it):
    no other module names a Slurm command in a string (an argv's first word, or a command line) or
    reads a key of Slurm's JSON. The job script's template is the other place that speaks to Slurm
    (it says which Slurm features it relies on)."""
    import ast

    offenders = []
    for path in sorted(TOOLKIT.rglob("*.py")):
        relative = path.relative_to(TOOLKIT)
        if relative.parts[0] == "slurm":
            continue
        for node in non_doc_strings(ast.parse(path.read_text())):
            words = node.value.split()
            command = node.value in SLURM_COMMANDS or (len(words) > 1 and words[0] in SLURM_COMMANDS and (
                words[1].startswith("-") or words[1] in SLURM_SUBCOMMANDS))  # not a message ("srun failed")
            if command or node.value in SLURM_JSON_KEYS:
                offenders.append(f"toolkit/{relative}:{node.lineno}: {node.value[:60]!r}")
    assert offenders == [], "Slurm spelled outside toolkit/slurm:\n" + "\n".join(offenders)
