"""One training rank: DeepSpeed + transformers + peft, SFT with LoRA or full fine-tuning.

Started by toolkit.train.workers with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set. Resumes by
itself from the newest valid checkpoint, so a requeue, a restart or a resubmit continues the run.
Exit status: 0 done (or checkpointed on request), 4 user error (NaN loss), 5 out of memory,
1 anything else.

Fault injection, for tests of paths a CPU cannot reach for real (set in the recipe's env):
  FT_FAULT_OOM_AT_STEP=N   rank 0 raises torch.OutOfMemoryError at step N (first attempt only)
  FT_FAULT_NAN_AT_STEP=N   the step's loss is NaN at step N
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

from toolkit.train.checkpoint import CheckpointStore, step_of
from toolkit.train.data import Example, batch_indices, collate, rank_slice
from toolkit.train.step_signals import Agreement, LossWindow, StepRecord
from toolkit.watch import exits, stacks
from toolkit.watch.exits import leave_exit_status
from toolkit.watch.progress import Reporter

_stop_requested = False


def request_stop(_signum, _frame) -> None:
    global _stop_requested
    _stop_requested = True


def log(rank: int, message: str) -> None:
    print(f"[rank {rank} {time.strftime('%H:%M:%S')}] {message}", flush=True)


def micro_batch(recipe: dict, world: int) -> int:
    """The recipe's micro batch; on the job's one retry after running out of memory, a smaller one
    that keeps the global batch (the rule in toolkit.recipe.schema, shared with the login side)."""
    from toolkit.recipe.schema import out_of_memory_micro_batch

    training = recipe["training"]
    if os.environ.get("FT_OOM_RETRY") != "1":
        return training["micro_batch"]
    return out_of_memory_micro_batch(training["micro_batch"], training["global_batch"], world)


def deepspeed_config(recipe: dict, world: int, total_steps: int) -> dict:
    training = recipe["training"]
    micro = micro_batch(recipe, world)
    accumulation = training["global_batch"] // (micro * world)
    warmup = max(1, training["warmup_steps"])  # DeepSpeed's schedulers refuse 0
    schedulers = {
        "cosine": {"type": "WarmupCosineLR", "params": {"total_num_steps": total_steps,
                                                        "warmup_num_steps": warmup}},
        "linear": {"type": "WarmupDecayLR", "params": {"total_num_steps": total_steps, "warmup_min_lr": 0,
                                                       "warmup_max_lr": training["learning_rate"],
                                                       "warmup_num_steps": warmup}},
        "constant": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": training["learning_rate"],
                                                    "warmup_num_steps": warmup}},
    }
    config = {
        "train_batch_size": training["global_batch"],
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "gradient_clipping": training["max_grad_norm"],
        # torch's AdamW: DeepSpeed's fused/CPU Adam would compile an op on first use.
        "optimizer": {"type": "AdamW", "params": {"lr": training["learning_rate"], "torch_adam": True,
                                                  "weight_decay": 0.0}},
        "scheduler": schedulers[training["lr_schedule"]],
        "zero_optimization": {"stage": training["zero_stage"]},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if training["precision"] == "bf16":
        config["bf16"] = {"enabled": True}
    elif training["precision"] == "fp16":
        config["fp16"] = {"enabled": True}
    return config


def sequence_logps(logits, labels):
    """Sum of the log-probabilities of each sequence's labelled tokens."""
    import torch

    shifted_logits, shifted_labels = logits[:, :-1, :], labels[:, 1:]
    mask = shifted_labels != -100
    gathered = torch.gather(shifted_logits.log_softmax(-1), 2, shifted_labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (gathered * mask).sum(-1)


def dpo_loss(engine, batch, beta: float):
    """DPO on a batch holding the chosen sequences, then the rejected ones. The reference model is
    the base model itself: the policy with its LoRA adapters switched off."""
    import torch
    import torch.nn.functional as F

    logps = sequence_logps(engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                           batch["labels"])
    with torch.no_grad(), engine.module.disable_adapter():
        reference = sequence_logps(engine.module(input_ids=batch["input_ids"],
                                                 attention_mask=batch["attention_mask"]).logits, batch["labels"])
    half = logps.shape[0] // 2
    chosen, rejected = logps[:half] - reference[:half], logps[half:] - reference[half:]
    loss = -F.logsigmoid(beta * (chosen - rejected)).mean()
    accuracy = (chosen > rejected).float().mean()
    return loss, accuracy


def seed_step(seed: int, device) -> None:
    """Dropout and every other random draw of a step follow from (seed, step, rank): a resumed run
    repeats exactly what the uninterrupted one would have done. Only the generators a step draws
    from are seeded (the host's and the rank's GPU): torch.manual_seed seeds every backend torch
    knows (CUDA, XPU, MTIA, MPS) and cost 1.5 ms a step on the CPU here (cProfile, a 64x2 model)."""
    import torch

    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)  # the current device: set to LOCAL_RANK's at start


def total_steps(recipe: dict, dataset_size: int) -> int:
    training = recipe["training"]
    if training.get("steps"):
        return int(training["steps"])
    return max(1, math.ceil(training["epochs"] * dataset_size / training["global_batch"]))


class Tracker:
    """Metrics to metrics.jsonl in the run directory, and to W&B (offline on the lab)."""

    def __init__(self, run_dir: Path, recipe: dict, rank: int):
        self.enabled = rank == 0
        self.path = run_dir / "metrics.jsonl"
        self.wandb = None
        wandb_spec = recipe["tracking"]["wandb"]
        if self.enabled and wandb_spec["mode"] != "disabled":
            import wandb

            self.wandb = wandb.init(project=wandb_spec["project"] or "ft", entity=wandb_spec["entity"],
                                    mode=wandb_spec["mode"], dir=str(run_dir), tags=wandb_spec["tags"],
                                    name=os.environ.get("FT_RUN_ID"), id=os.environ.get("FT_RUN_ID"),
                                    resume="allow", config=recipe)
            link = getattr(self.wandb, "url", None) or str(Path(self.wandb.dir).parent)
            (run_dir / "tracking.json").write_text(json.dumps({"wandb": link, "mode": wandb_spec["mode"]}) + "\n")

    def log(self, records: list[StepRecord]) -> None:
        """Several steps at once: one append to metrics.jsonl (see step_signals for why batched)."""
        if not self.enabled or not records:
            return
        metrics = [{"loss": r.loss, "lr": r.lr, "tokens": r.tokens}
                   | ({"reward_accuracy": r.accuracy} if r.accuracy is not None else {}) for r in records]
        with open(self.path, "a") as handle:
            handle.write("".join(json.dumps({"step": r.step, "time": round(r.time, 3), **m}) + "\n"
                                 for r, m in zip(records, metrics, strict=True)))
        if self.wandb:
            try:
                for record, values in zip(records, metrics, strict=True):
                    self.wandb.log(values, step=record.step)
            except Exception as exc:  # noqa: BLE001 - W&B failing (its service killed, say) never stops training
                print(f"warning: W&B stopped taking metrics ({type(exc).__name__}: {exc}); they go on in "
                      f"{self.path} only", flush=True)
                self.wandb = None

    def artifact(self, folder: Path) -> None:
        if self.wandb:
            import wandb

            artifact = wandb.Artifact(f"{os.environ.get('FT_RUN_ID', 'ft')}-adapter", type="model")
            artifact.add_dir(str(folder))
            self.wandb.log_artifact(artifact)

    def finish(self) -> None:
        if self.wandb:
            try:
                self.wandb.finish()
            except Exception as exc:  # noqa: BLE001 - as in log()
                print(f"warning: W&B did not finish cleanly ({type(exc).__name__}: {exc})", flush=True)


def load_base_model(model_path: Path, method: str, precision: str):
    """The base model in the training precision: 4-bit NF4 with double quantization for QLoRA
    (bitsandbytes, computing in that precision), else plain weights. DeepSpeed casts the module to
    bf16/fp16 anyway, so loading it so changes no value and halves the host memory and the load time
    (an 8B rank loading fp32 peaked at 45.7 GiB: benchmarks/GPU.md)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    if method != "qlora":
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=quantization, dtype=dtype)
    quantized = sum(type(module).__name__ == "Linear4bit" for module in model.modules())
    print(f"QLoRA: {quantized} linear layers in 4-bit NF4", flush=True)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def cache_root(shared_root: str, run_dir: Path) -> Path:
    """The user's cache on the shared filesystem; the run's own folder when that may not be used
    (another user made it, say): the run goes on, and only the reuse across runs is lost."""
    from toolkit.shared_dirs import SharedFolderError, private_dir, user_cache

    try:
        return user_cache(shared_root)
    except SharedFolderError as exc:
        fallback = private_dir(run_dir / "cache")
        print(f"warning: {exc.message} ({exc.hint}); this run caches in {fallback} instead", flush=True)
        return fallback


def load_examples(recipe: dict, model_path: Path, user_cache: Path, rank: int, dist) -> list[Example]:
    """The tokenized training set, from the cache `ft validate` filled; built (by rank 0, once) when
    the run was submitted without validation or the cache was purged."""
    from toolkit.data import object_store
    from toolkit.data.recipe_data import dataset_key, token_cache
    from toolkit.data.tokenizer import load_length_counter
    from toolkit.recipe.schema import Recipe

    object_store.configure()  # s3:// data: the job's AWS_ENDPOINT_URL (from the profile), bounded timeouts
    spec = Recipe.model_validate(recipe)
    counter = load_length_counter(str(model_path))
    key = dataset_key(spec, spec.data.train, counter, "train")
    cache = token_cache(user_cache)
    if rank == 0 and cache.meta(key) is None:  # the digests, checked once for every rank
        build_cache(spec, counter, cache, key)
    dist.barrier()
    dataset = cache.load(key, digests=False)
    if dataset is None:
        raise RuntimeError(f"the tokenized dataset {cache.path(key)} is missing after rank 0 built it")
    log(rank, f"{len(dataset.offsets) - 1} sequences from the token cache {cache.path(key).name}")
    return [Example(ids, labels) for ids, labels in dataset.examples(held_out=False)]


def build_cache(recipe, counter, cache, key: str) -> None:
    """Tokenize the training file the way validation does (a run submitted with --skip-validation)."""
    from toolkit.data.encode import encode_rows, sequences_per_row
    from toolkit.data.readers import open_rows
    from toolkit.data.recipe_data import held_out_fraction
    from toolkit.data.schemas import detect_format
    from toolkit.data.split import is_eval

    data = recipe.data
    rows = [row.data for row in open_rows(data.train)[0] if row.data is not None]
    fmt = data.format if data.format != "auto" else detect_format(rows[0])
    fraction, per_row = held_out_fraction(recipe, "train"), sequences_per_row(fmt)
    encoded = encode_rows(rows, fmt, counter, data.max_seq_len)
    writer = cache.writer(key)
    for index, row in enumerate(rows):
        held_out = is_eval(row, fraction, recipe.training.seed)
        for ids, labels, _ in encoded[index * per_row:(index + 1) * per_row]:
            writer.add(ids, labels, held_out)
    writer.finish({"key": key, "path": data.train, "format": fmt, "report": None})


def main() -> None:  # noqa: C901 - the training loop reads best in one place
    signal.signal(signal.SIGUSR2, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    # The watchdog's way to see where a hung rank is when py-spy is not installed.
    faulthandler.register(stacks.FAULTHANDLER_SIGNAL, all_threads=True)
    progress = Reporter()
    run_dir = Path(os.environ["FT_RUN_DIR"])
    shared_root = os.environ.get("FT_SHARED_ROOT", str(run_dir.parent.parent))
    recipe = json.loads((run_dir / "recipe.json").read_text())
    backend = os.environ.get("FT_DIST_BACKEND", "nccl")

    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from toolkit.train import compiled_ops
    from toolkit.train.models import resolve_model

    user_cache = cache_root(shared_root, run_dir)
    compiled_ops.prepare(user_cache, lambda message: print(f"warning: {message}", flush=True))
    if backend == "nccl":
        # Each rank takes the GPU its LOCAL_RANK names before the first collective (the barrier in
        # load_examples); otherwise torch guesses one from the global rank, which can hang.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(recipe["training"]["seed"])
    model_path = resolve_model(recipe["model"]["base"], recipe["model"]["revision"], shared_root, user_cache)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    method = recipe["method"]
    model = load_base_model(model_path, method["kind"], recipe["training"]["precision"])
    if recipe["training"]["gradient_checkpointing"]:
        model.gradient_checkpointing_enable()
    if method["kind"] in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=method["rank"], lora_alpha=method["alpha"],
                                                 lora_dropout=method["dropout"],
                                                 target_modules=method["target_modules"], task_type="CAUSAL_LM"))

    examples = load_examples(recipe, model_path, user_cache, rank, dist)
    dpo = recipe["objective"]["kind"] == "dpo"
    if dpo:
        examples = list(zip(examples[0::2], examples[1::2], strict=True))
    steps = total_steps(recipe, len(examples))
    config = deepspeed_config(recipe, world, steps)
    accumulation = config["gradient_accumulation_steps"]
    engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    store = CheckpointStore(Path(recipe["checkpoint"]["staging"] or run_dir / "checkpoints"),
                            recipe["checkpoint"]["keep_last"])
    start = 0
    tag = store.choose(lambda message: log(rank, f"warning: {message}"))
    if tag:
        engine.load_checkpoint(str(store.root), tag=tag, load_module_strict=False)
        start = step_of(tag)
        log(rank, f"resumed from checkpoint {tag}")
    tracker = Tracker(run_dir, recipe, rank)
    every_steps = recipe["checkpoint"]["every_steps"]
    every_seconds = (recipe["checkpoint"]["every_minutes"] or 0) * 60
    last_save, started, tokens = time.monotonic(), time.monotonic(), 0

    checkpoint_seconds, checkpoints_written = 0.0, 0

    def save(step: int) -> None:
        nonlocal last_save, checkpoint_seconds, checkpoints_written
        save_started = time.monotonic()
        progress.report("save", step)
        if rank == 0:
            store.prepare()
        dist.barrier()
        engine.save_checkpoint(str(store.staging), tag=f"step-{step:08d}", save_latest=False,
                               exclude_frozen_parameters=method["kind"] != "full")
        dist.barrier()
        if rank == 0:
            store.publish(step)
        dist.barrier()
        last_save = time.monotonic()
        progress.report("step", step)  # the save is over: the hang rule's step clock again, from now
        checkpoint_seconds += last_save - save_started
        checkpoints_written += 1
        log(rank, f"checkpoint step {step} saved in {last_save - save_started:.2f} s")

    fault_oom = int(os.environ.get("FT_FAULT_OOM_AT_STEP", "0"))
    fault_nan = int(os.environ.get("FT_FAULT_NAN_AT_STEP", "0"))
    window = LossWindow(recipe["tracking"].get("log_every_steps", 1), world)
    agreement = Agreement(dist, backend)

    def read_losses() -> None:
        """The pending steps' losses: NaN check, metrics, the log line every 10 steps."""
        records = window.read(dist)
        for record in records:
            loss = record.loss if record.step != fault_nan else float("nan")
            if not math.isfinite(loss):
                log(rank, f"loss is {loss} at step {record.step}: stopping. Try a lower learning rate "
                          f"(now {recipe['training']['learning_rate']}), gradient clipping (max_grad_norm), "
                          "and `ft validate` on the data.")
                tracker.log([r for r in records if r.step < record.step])
                leave_exit_status(run_dir, exits.USER_ERROR)  # every rank: whichever srun stops last
                sys.exit(exits.USER_ERROR)
            if rank == 0 and (record.step % 10 == 0 or record.step == start + 1):
                log(rank, f"step {record.step}/{steps} loss {loss:.4f}")
        tracker.log(records)

    log(rank, f"training steps {start}..{steps} world={world} micro batch {config['train_micro_batch_size_per_gpu']} "
              f"accumulation={accumulation} backend={backend}")
    step = start
    for step in range(start + 1, steps + 1):
        indices = batch_indices(step - 1, recipe["training"]["seed"], len(examples), config["train_batch_size"])
        seed_step(recipe["training"]["seed"] * 1_000_003 + step * 4099 + rank, engine.device)
        losses, accuracies = [], []
        try:
            for micro in range(accumulation):
                part = [examples[i] for i in rank_slice(indices, rank, world,
                                                        config["train_micro_batch_size_per_gpu"], micro)]
                if dpo:  # examples are (chosen, rejected) pairs: chosen first, then rejected
                    part = [pair[0] for pair in part] + [pair[1] for pair in part]
                batch = collate(part, tokenizer.pad_token_id)
                tokens += int(batch["attention_mask"].sum())
                batch = {key: value.to(engine.device) for key, value in batch.items()}  # DeepSpeed moves no inputs
                if rank == 0 and step == fault_oom and os.environ.get("FT_OOM_RETRY") != "1":
                    raise torch.OutOfMemoryError(f"injected by FT_FAULT_OOM_AT_STEP={fault_oom}")
                if dpo:
                    loss, accuracy = dpo_loss(engine, batch, recipe["objective"]["beta"])
                    accuracies.append(accuracy)
                else:
                    loss = engine(**batch).loss
                engine.backward(loss)
                engine.step()
                losses.append(loss.detach())
        except torch.OutOfMemoryError as exc:
            log(rank, f"out of memory at step {step} with micro batch {config['train_micro_batch_size_per_gpu']}: "
                      f"{exc}")
            leave_exit_status(run_dir, exits.OUT_OF_MEMORY)
            sys.exit(exits.OUT_OF_MEMORY)
        progress.report("step", step)
        window.add(step, torch.stack(losses).mean(), torch.stack(accuracies).mean() if accuracies else None,
                   engine.get_lr()[0], tokens * world)
        stop_now, clock_due = agreement.agree(_stop_requested, time.monotonic() - last_save >= every_seconds > 0)
        save_now = bool(every_steps and step % every_steps == 0) or clock_due or stop_now or step == steps
        if save_now or window.due(step) or step == start + 1:
            read_losses()
        if save_now:
            save(step)
        if stop_now and step < steps:
            log(rank, f"stopping at step {step} on request (checkpoint saved); the job continues after requeue")
            tracker.finish()
            leave_exit_status(run_dir, exits.STOPPED)  # not done: the job script requeues the job
            sys.exit(exits.STOPPED)

    progress.report("export", step)
    timing = {"wall_seconds": round(time.monotonic() - started, 2), "checkpoint_seconds": round(checkpoint_seconds, 2),
              "checkpoints": checkpoints_written}
    export(engine, tokenizer, run_dir, recipe, step, tokens * world, timing, tracker, rank)
    dist.barrier()
    tracker.finish()


def export(engine, tokenizer, run_dir: Path, recipe: dict, step: int, tokens: int, timing: dict, tracker,
           rank: int) -> None:
    """The adapter (LoRA) or the consolidated weights (full), in safetensors, with the tokenizer.
    Under ZeRO-3 the parameters are sharded: every rank joins the gather, rank 0 writes."""
    import deepspeed

    output = run_dir / "output"
    parameters = list(engine.module.parameters())
    sharded = engine.zero_optimization_stage() == 3
    with deepspeed.zero.GatheredParameters(parameters, modifier_rank=None, enabled=sharded):
        if rank == 0:
            output.mkdir(exist_ok=True)
            engine.module.save_pretrained(output, safe_serialization=True, is_main_process=True)
    if rank != 0:
        return
    tokenizer.save_pretrained(output)
    curve = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        curve = [(m["step"], m["loss"]) for m in map(json.loads, metrics.read_text().splitlines())]
    gpus = int(os.environ.get("SLURM_GPUS_ON_NODE", "0") or 0) * int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
    summary = {"steps": step, "tokens": tokens, **timing, "gpu_hours": round(gpus * timing["wall_seconds"] / 3600, 4),
               "final_loss": curve[-1][1] if curve else None,
               "loss_curve": curve, "output": str(output), "method": recipe["method"]["kind"]}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (run_dir / exits.DONE_SENTINEL).write_text(f"{step}\n")  # a requeue after this point never reruns the run
    tracker.artifact(output)
    print(f"[rank 0] wrote {output} and summary.json", flush=True)


if __name__ == "__main__":
    main()
