"""What the receipts' tests share: the site's key, a signer on a temporary socket, and a run that
records what a LoRA run records. The lab is not used: a fake Slurm (squeue, and scontrol's batch
script) stands in for Slurm's answers (the signer's Slurm queries take a runner), so these tests never
touch a running cluster; tests/lab/test_receipts_lab.py asks the lab's real Slurm."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

from toolkit.base.shared_dirs import login_name
from toolkit.receipts import keys
from toolkit.receipts.chain import GENESIS, Receipt, entry_hash
from toolkit.receipts.ledger import Ledger
from toolkit.receipts.site import ReceiptSigning
from toolkit.services import signer
from toolkit.slurm.commands import CommandResult


def squeue_answer(*jobs: dict) -> str:
    """`squeue --all --json` as Slurm answers it, with these jobs."""
    return json.dumps({"jobs": [{"job_id": 100 + index, "job_state": "RUNNING", "user_name": login_name(os.getuid()),
                                 "batch_host": "node1", "comment": "ft-run=run-1"} | job
                                for index, job in enumerate(jobs)]})


# What every fake job runs, as Slurm holds it: the job script the test receipts record (ft's, of run-1).
JOB_SCRIPT = "#!/bin/bash\n# ft job script: run run-1 of recipe tiny on cluster lab.\nexec python3 -m toolkit.job\n"


class FakeSqueue:
    """Stands in for squeue and `scontrol write batch_script` (each job's script: JOB_SCRIPT unless
    `scripts` names another): the lab is busy with other tests and is not this suite's to ask."""

    def __init__(self, *jobs: dict, scripts: dict[str, str] | None = None):
        self.text, self.calls, self.scripts = squeue_answer(*jobs), 0, scripts or {}

    def __call__(self, argv, timeout, check=True):
        if list(argv[:3]) == ["scontrol", "write", "batch_script"]:
            return CommandResult(tuple(argv), 0, self.scripts.get(argv[3], JOB_SCRIPT), "")
        assert list(argv) == ["squeue", "--all", "--json"]
        self.calls += 1
        return CommandResult(tuple(argv), 0, self.text, "")


def submit_entry(run_id: str = "run-1", script: str = JOB_SCRIPT) -> dict:
    """A receipt's first entry as `ft submit` writes it: the run, and the job script it recorded."""
    import hashlib

    entry = {"seq": 1, "kind": "submit", "time": 0, "body": {"run_id": run_id},
             "artifacts": {"job_script": {"path": "job.sbatch", "bytes": len(script.encode()),
                                          "sha256": hashlib.sha256(script.encode()).hexdigest()}},
             "prev": GENESIS}
    return entry | {"hash": entry_hash(entry)}


def site_key(folder: Path):
    """A key made as Ansible makes it, and the profile section naming its public half."""
    path = folder / "signing" / "receipt.key"
    keys.generate(path)
    private = keys.load_private_key(path)
    raw = keys.raw_public(private)
    return private, ReceiptSigning(public_key=base64.b64encode(raw).decode(), key_id=keys.key_id(raw),
                                   socket=str(folder / "signer.sock"))


@contextlib.contextmanager
def running_signer(private_key, socket_path: Path, squeue: Callable, ledger: Path | None = None):
    """A signer serving on `socket_path` in this process, asking `squeue` (a FakeSqueue, or a runner
    that fails), remembering what it signed in `ledger` (a folder) where one is given."""
    server = signer.SignerServer(socket_path, signer.Signer(private_key, signer.RunningJobs(squeue),
                                                            ledger=Ledger(ledger), run=squeue))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def record_a_run(run_dir: Path, data: Path) -> Receipt:
    """The entries of a LoRA run: submit (its data), two attempts, two checkpoints (their manifests),
    the adapter folder, its evaluation."""
    (run_dir / "checkpoints" / "step-00000010").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-00000020").mkdir(parents=True)
    (run_dir / "output").mkdir()
    (run_dir / "recipe.resolved.yaml").write_text("model: tiny\n")
    for step in (10, 20):
        (run_dir / "checkpoints" / f"step-{step:08d}" / "manifest.json").write_text(json.dumps({"step": step}))
    (run_dir / "output" / "adapter_model.safetensors").write_bytes(os.urandom(4096))
    (run_dir / "output" / "adapter_config.json").write_text('{"r": 16}')
    (run_dir / "eval.json").write_text('{"loss": 1.5}')
    (run_dir / "job.sbatch").write_text(JOB_SCRIPT)
    receipt = Receipt(run_dir)
    receipt.append("submit", {"ft_version": "0.1.0", "commit": "abc", "run_id": run_dir.name},
                   {"data": data, "recipe": run_dir / "recipe.resolved.yaml", "job_script": run_dir / "job.sbatch"})
    receipt.append("attempt", {"job": "100", "nodes": ["node1", "node2"]})
    receipt.append("attempt", {"job": "100", "exit_class": "node_lost"})
    for step in (10, 20):
        receipt.append("checkpoint", {"step": step},
                       {"manifest": run_dir / "checkpoints" / f"step-{step:08d}" / "manifest.json"}, prunable=True)
    receipt.append("adapter", {"method": "lora"}, {"adapter": run_dir / "output"})
    receipt.append("eval", {"loss": 1.5}, {"results": run_dir / "eval.json"})
    return receipt
