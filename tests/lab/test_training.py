"""The training runtime on the lab, through `ft submit`: a 2-node DeepSpeed ZeRO-2 LoRA SFT that
learns its task; exact resume after a requeue; NaN and out-of-memory handling; DPO, ZeRO-3, QLoRA and
chat data; a node lost at step launch; a poisoned model cache (tests/lab/test_recovery.py: faults in
training, and what ft's watchdog recovers)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tests.support.slurm import job_fields, wait_for
from tests.support.training import REPO, TINY, assert_same_weights, ft, lab_runs, submit, tiny_recipe, wait_done
from toolkit.slurm import commands

PAIRS = [("cat", "chat"), ("dog", "chien"), ("house", "maison"), ("water", "eau"), ("moon", "lune"),
         ("bird", "oiseau")]

pytest.importorskip("deepspeed", reason="the training stack (ft[train]) is not installed")


@pytest.fixture(scope="module")
def runs_env(lab, tmp_path_factory):
    runs = lab_runs(lab, "training")
    previous = os.environ.get("FT_RUNS_DIR")
    os.environ["FT_RUNS_DIR"] = str(runs)
    yield runs
    if previous is None:
        os.environ.pop("FT_RUNS_DIR")
    else:
        os.environ["FT_RUNS_DIR"] = previous


@pytest.fixture(scope="module")
def baseline(tiny_baseline, runs_env) -> dict:
    return tiny_baseline


def test_two_node_lora_sft_learns_the_task(baseline):
    run_dir = Path(baseline["run_dir"])
    summary = json.loads((run_dir / "summary.json").read_text())
    curve = [loss for _, loss in summary["loss_curve"]]
    assert summary["steps"] == 120
    assert sum(curve[-10:]) / 10 < 0.5 * sum(curve[:10]) / 10  # the loss falls by more than half

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = run_dir / "output"
    config = json.loads((adapter / "adapter_config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"]),
                                      adapter).eval()
    correct = 0
    for english, french in PAIRS:
        ids = [tokenizer.bos_token_id] + tokenizer(f"Translate to French: {english}\nAnswer:",
                                                   add_special_tokens=False)["input_ids"]
        output = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        correct += tokenizer.decode(output[0][len(ids):], skip_special_tokens=True).strip() == french
    assert correct >= len(PAIRS) - 1, f"greedy output right for only {correct} of {len(PAIRS)} words"
    # Both nodes trained: one log per rank, each with its steps.
    assert {p.name for p in (run_dir / "logs").glob("rank-*.log")} == {"rank-0.log", "rank-1.log"}
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000120"


@pytest.mark.slurm_matrix
def test_requeued_run_resumes_and_ends_with_the_same_weights(baseline, runs_env):
    run = submit(TINY)
    latest = Path(run["run_dir"]) / "checkpoints" / "latest"
    wait_for("the first checkpoint", lambda: latest.exists(), timeout=240, interval=0.5)
    interrupted_at = latest.read_text().strip()
    commands.run(["scontrol", "requeue", run["job_id"]])

    assert wait_done(run["run_id"], timeout=400) == "COMPLETED"
    attempts = [json.loads(line) for line in (Path(run["run_dir"]) / "attempts.jsonl").read_text().splitlines()]
    assert [a["restart"] for a in attempts] == [0, 1]
    rank0 = (Path(run["run_dir"]) / "logs" / "rank-0.log").read_text()
    assert "resumed from checkpoint step-" in rank0

    assert_same_weights(Path(baseline["run_dir"]), Path(run["run_dir"]), f"(interrupted at {interrupted_at})")


def tiny_model_entry(lab) -> Path:
    """Where runs of this user keep the tiny model: in the user's own cache (toolkit/base/shared_dirs.py)."""
    return Path(lab.shared_dir) / "cache" / f"uid-{os.getuid()}" / "models" / "tiny-llama-h256-l2"


def faulty_recipe(shared_tmp: Path, **env: str) -> Path:
    recipe = tiny_recipe()
    recipe["data"]["train"] = str(REPO / "recipes" / "data" / "tiny-sft.jsonl")
    recipe["training"]["steps"] = 30
    recipe["env"] = env
    path = shared_tmp / "faulty.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_nan_loss_stops_at_once_as_a_user_error(lab, runs_env, shared_tmp):
    run = submit(faulty_recipe(shared_tmp, FT_FAULT_NAN_AT_STEP="3"))

    assert wait_done(run["run_id"]) == "FAILED"
    rank0 = (Path(run["run_dir"]) / "logs" / "rank-0.log").read_text()
    assert "loss is nan at step 3: stopping" in rank0 and "lower learning rate" in rank0
    exit_code = commands.run(["sacct", "-j", run["job_id"], "--allocations", "--noheader", "--parsable2",
                              "--format=ExitCode"]).stdout.strip()
    assert exit_code == "4:0"  # distinct from a crash: ft does not requeue it
    assert "not worth a requeue" in (Path(run["run_dir"]) / "logs" / f"slurm-{run['job_id']}.out").read_text()
    assert not (Path(run["run_dir"]) / "output").exists()


def test_out_of_memory_retries_once_from_the_checkpoint_with_a_micro_batch_that_keeps_the_global_batch(
        lab, runs_env, shared_tmp):
    """Halving 5 would give 2, which does not divide a rank's 5 examples: DeepSpeed would refuse the
    batch. The retry takes the rule the login side shows (`ft recipe explain`): micro batch 1. (The
    rule's other cases, plain halving among them, are unit tests: tests/unit/test_recipes.py.)"""
    recipe = yaml.safe_load(faulty_recipe(shared_tmp, FT_FAULT_OOM_AT_STEP="25").read_text())
    recipe["training"].update(micro_batch=5, global_batch=10)
    path = shared_tmp / "odd.yaml"
    path.write_text(yaml.safe_dump(recipe))
    explained = json.loads(ft("recipe", "explain", str(path), "--json").stdout)
    assert explained["values"]["derived.out_of_memory_micro_batch"] == 1

    run = submit(path)

    assert wait_done(run["run_id"]) == "COMPLETED", ft("logs", run["run_id"], "--rank", "0").stdout[-3000:]
    batch_log = (Path(run["run_dir"]) / "logs" / f"slurm-{run['job_id']}.out").read_text()
    assert batch_log.count("retrying once with a smaller micro batch") == 1
    rank0 = (Path(run["run_dir"]) / "logs" / "rank-0.log").read_text()
    assert "out of memory at step 25 with micro batch 5" in rank0
    assert "resumed from checkpoint step-00000020" in rank0
    assert "micro batch 1 accumulation=5" in rank0  # the same global batch of 10 over 2 ranks
    assert json.loads((Path(run["run_dir"]) / "summary.json").read_text())["steps"] == 30


def test_dpo_learns_to_prefer_the_chosen_answers(lab, runs_env):
    run = submit(REPO / "recipes" / "tiny-dpo.yaml")

    assert wait_done(run["run_id"]) == "COMPLETED", ft("logs", run["run_id"], "--rank", "0").stdout[-3000:]
    metrics = [json.loads(line) for line in (Path(run["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    first, last = metrics[:5], metrics[-5:]
    assert sum(m["loss"] for m in last) / 5 < sum(m["loss"] for m in first) / 5
    assert sum(m["loss"] for m in last) / 5 < 0.6931  # better than no preference at all: log(2)
    assert sum(m["reward_accuracy"] for m in last) / 5 >= 0.9
    assert (Path(run["run_dir"]) / "output" / "adapter_model.safetensors").exists()


def test_full_fine_tune_with_zero3_is_consolidated(lab, runs_env):
    run = submit(REPO / "recipes" / "tiny-full-zero3.yaml")

    assert wait_done(run["run_id"]) == "COMPLETED", ft("logs", run["run_id"], "--rank", "0").stdout[-3000:]
    run_dir = Path(run["run_dir"])
    # ZeRO-3 sharded the parameters: each rank wrote its own part of the model states.
    checkpoint = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    assert {p.name for p in checkpoint.glob("zero_pp_rank_*_model_states.pt")} == {
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"}
    import torch
    from transformers import AutoModelForCausalLM

    output = run_dir / "output"
    assert (output / "model.safetensors").exists() and not list(output.glob("adapter_*"))
    model = AutoModelForCausalLM.from_pretrained(output)  # one consolidated model, loadable as is
    base = AutoModelForCausalLM.from_pretrained(tiny_model_entry(lab))
    changed = [name for name, tensor in model.state_dict().items() if not torch.equal(tensor, base.state_dict()[name])]
    assert len(changed) > 10  # the whole model trained, not adapters
    curve = json.loads((run_dir / "summary.json").read_text())["loss_curve"]
    assert curve[-1][1] < curve[0][1]


def test_qlora_on_one_node_trains_a_4bit_base(lab, runs_env):
    run = submit(REPO / "recipes" / "tiny-qlora.yaml")

    assert wait_done(run["run_id"]) == "COMPLETED", ft("logs", run["run_id"], "--rank", "0").stdout[-3000:]
    run_dir = Path(run["run_dir"])
    rank0 = (run_dir / "logs" / "rank-0.log").read_text()
    assert "QLoRA: 14 linear layers in 4-bit NF4" in rank0  # 7 projections x 2 layers
    curve = [loss for _, loss in json.loads((run_dir / "summary.json").read_text())["loss_curve"]]
    assert sum(curve[-5:]) / 5 < 0.7 * sum(curve[:5]) / 5
    assert json.loads((run_dir / "output" / "adapter_config.json").read_text())["r"] == 16
    assert len(json.loads((run_dir / "attempts.jsonl").read_text().splitlines()[0])["nodes"]) == 1


def test_sft_on_chat_messages_learns_the_assistant_turns(lab, runs_env, shared_tmp):
    recipe = tiny_recipe()
    recipe["name"] = "tiny-chat"
    recipe["data"]["train"] = str(REPO / "recipes" / "data" / "tiny-chat.jsonl")
    recipe["training"]["steps"] = 80
    path = shared_tmp / "chat.yaml"
    path.write_text(yaml.safe_dump(recipe))

    run = submit(path)

    assert wait_done(run["run_id"]) == "COMPLETED", ft("logs", run["run_id"], "--rank", "0").stdout[-3000:]
    curve = [loss for _, loss in json.loads((Path(run["run_dir"]) / "summary.json").read_text())["loss_curve"]]
    assert sum(curve[-5:]) / 5 < 0.5 * sum(curve[:5]) / 5
    report = json.loads((Path(run["run_dir"]) / "data-report.json").read_text())
    assert report[0]["format"] == "chat" and report[0]["ok"]


def filler_job(shared_tmp: Path, nodes: list[str]) -> str:
    """A job holding these nodes (cancel it once done): the next job gets the others."""
    from tests.support.slurm import sbatch, write_script

    return sbatch(write_script(shared_tmp / "filler.sh", "srun sleep 600\n"), f"--nodes={len(nodes)}",
                  f"--nodelist={','.join(nodes)}", f"--output={shared_tmp}/filler-%j")


def short_job_script(shared_tmp: Path, run_id: str) -> Path:
    """The job script of a short tiny run (faulty_recipe's, with no fault), rendered for sbatch."""
    rendered = ft("render", str(faulty_recipe(shared_tmp)), "--run-id", run_id, "-o", str(shared_tmp / "job.sbatch"))
    assert rendered.returncode == 0, rendered.stderr
    return shared_tmp / "job.sbatch"


def job_end(job_id: str) -> dict:
    return wait_for("the requeued run to finish", lambda: (lambda f: f if f.get("JobState") in {
        "COMPLETED", "FAILED", "CANCELLED"} else None)(job_fields(job_id)), timeout=400, interval=2)


def node_reason(node: str) -> str:
    return commands.run(["sinfo", "--noheader", "--Node", "--nodes", node, "--format=%E"]).stdout


def test_a_node_lost_before_the_step_starts_is_marked_down_and_the_run_requeued(lab, runs_env, shared_tmp, heal_lab):
    """Slurm allocates a node whose slurmd just died (it still looks idle): the step cannot start
    there. A platform fault, not the run's: the job marks the node down, Slurm requeues it at once
    (long before it would notice the node itself), and the run completes on other nodes."""
    from tests.support.slurm import cancel, hostnames, sbatch
    from toolkit.lab import lifecycle

    names = [node.name for node in lab.nodes]
    filler = filler_job(shared_tmp, names[2:])
    job_id = None
    try:
        wait_for("the filler job to hold all but two nodes",
                 lambda: job_fields(filler).get("JobState") == "RUNNING", timeout=60)
        run_id = f"lost-at-launch-{shared_tmp.name}"
        # Held until its second node is dead, then released: Slurm gives it the two free nodes.
        job_id = sbatch(short_job_script(shared_tmp, run_id), "--hold")
        victim = names[1]
        assert lifecycle.crash(victim), f"nothing ran in {victim}'s namespace"
        commands.run(["scontrol", "release", job_id])

        run_dir = runs_env / run_id
        failures = wait_for("the job to see its lost node", lambda: (run_dir / "launch-failures").exists()
                            and (run_dir / "launch-failures").read_text(), timeout=90)
        assert failures.split() == [job_id, "none", victim]  # lost before any checkpoint of the run
        expected_reason = f"ft: lost before job {job_id} (run {run_id}) started on it"
        wait_for("the lost node to be marked down with its reason", lambda: expected_reason in node_reason(victim),
                 timeout=30)
        cancel(filler)

        final = job_end(job_id)
        batch_log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
        assert final["JobState"] == "COMPLETED", batch_log[-3000:]
        assert int(final["Restarts"]) == 1
        assert f"node {victim} was lost before the step started on it: marking it down" in batch_log
        attempts = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]
        assert len(attempts) == 1 and victim not in attempts[0]["nodes"]  # the failed start never trained
        assert victim not in hostnames(final["NodeList"])
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 30
        lifted = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
                  if '"requeue_hold_lifted"' in line]
        assert [e["job"] for e in lifted] == [job_id]  # requeued without Slurm's credential hold
    finally:
        cancel(filler, *([job_id] if job_id else []))


def test_the_prolog_gate_keeps_a_run_off_a_node_that_fails_a_check(lab, runs_env, shared_tmp, heal_lab):
    """ft-healthcheck is also the lab's Prolog (PrologFlags=Alloc): a node that fails a check as a
    job is allocated to it is drained, naming the job, and Slurm requeues the job at once onto other
    nodes (nohold_on_prolog_fail): nothing of the run ever starts there. The failing check is one
    this test installs beside the lab's real hooks, failing first as the Prolog of the victim: the
    periodic health check (every 5 s) would otherwise race the gate for the same finding."""
    from tests.support.slurm import cancel, hostnames, sbatch

    names = [node.name for node in lab.nodes]
    victim = names[-1]
    hook = Path("/etc/ft/healthcheck.d/99-test-gate")
    # Fails on the victim first as its Prolog, and from then on in every check there (a fault that
    # stays): the periodic check, passing, would otherwise resume the node the gate drained.
    tripped = shared_tmp / "gate-tripped"
    hook.write_text("#!/bin/bash\n"
                    f'if [ "$FT_HEALTHCHECK_NODE" = {victim} ]; then\n'
                    f'    [ "${{SLURM_SCRIPT_CONTEXT:-}}" = prolog_slurmd ] && touch {tripped}\n'
                    f'    [ -e {tripped} ] && {{ echo "GPU 3: a check failed as the job was allocated"; exit 1; }}\n'
                    "fi\n"
                    "exit 0\n")
    hook.chmod(0o755)
    filler = filler_job(shared_tmp, names[:-2])
    job_id = None
    try:
        wait_for("the filler job to hold all but two nodes",
                 lambda: job_fields(filler).get("JobState") == "RUNNING", timeout=60)
        run_id = f"gated-{shared_tmp.name}"
        job_id = sbatch(short_job_script(shared_tmp, run_id))  # the two free nodes: the victim among them
        wait_for("the gate to trip", tripped.exists, timeout=60)
        # The gate's drain names the job ("(before job N)"); the periodic check may have drained it
        # again since, with the same finding.
        expected_reason = "ft-healthcheck: 99-test-gate: GPU 3: a check failed as the job was allocated"
        wait_for("the victim drained", lambda: expected_reason in node_reason(victim), timeout=60)
        cancel(filler)

        final = job_end(job_id)
        run_dir = runs_env / run_id
        batch_log = (run_dir / "logs" / f"slurm-{job_id}.out").read_text()
        assert final["JobState"] == "COMPLETED", batch_log[-3000:]
        assert int(final["Restarts"]) >= 1 and victim not in hostnames(final["NodeList"])
        attempts = [json.loads(line) for line in (run_dir / "attempts.jsonl").read_text().splitlines()]
        assert len(attempts) == 1 and victim not in attempts[0]["nodes"]  # the gated start never began
        assert batch_log.count("ft: job ") == 1  # nor did its job script
    finally:
        hook.unlink(missing_ok=True)
        cancel(filler, *([job_id] if job_id else []))
        commands.run(["scontrol", "update", f"nodename={victim}", "state=resume"], check=False)


@pytest.mark.whole_lab  # the model cache it poisons is every run's, the other stream's too
def test_a_poisoned_model_cache_entry_is_rebuilt_and_the_run_completes(lab, runs_env, shared_tmp):
    """What once broke every run on a machine: the tiny model's folder marked complete, its
    config and weights missing. The run rebuilds it (saying so) instead of failing to load it."""
    entry = tiny_model_entry(lab)
    if not (entry / "model.safetensors").exists():  # the first run on a purged lab builds it
        first = submit(faulty_recipe(shared_tmp))
        assert wait_done(first["run_id"]) == "COMPLETED"
    (entry / "model.safetensors").unlink()
    (entry / "config.json").unlink()
    assert (entry / ".complete").exists()

    run = submit(faulty_recipe(shared_tmp))

    assert wait_done(run["run_id"]) == "COMPLETED", ft("logs", run["run_id"], "--rank", "0").stdout[-3000:]
    logs = "".join(p.read_text() for p in (Path(run["run_dir"]) / "logs").glob("rank-*.log"))
    assert f"the cached tiny model {entry} is not whole" in logs and "rebuilding it" in logs
    assert (entry / "model.safetensors").is_file() and (entry / "config.json").is_file()
