"""One training rank: DeepSpeed + transformers + peft; LoRA, QLoRA or full fine-tuning; SFT or DPO.

Started by toolkit.launch.workers with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set. Resumes by
itself from the newest valid checkpoint, so a requeue, a restart or a resubmit continues the run.
Exit status (toolkit/runs/exits.py): 0 done (or checkpointed on request: 8), 4 user error (NaN
loss), 5 out of memory, 1 anything else.

The parts, each in its module: the typed run spec (toolkit/recipe/run_spec.py, read through
toolkit/runs/layout.py), the model and method (models.py), the objective (objectives.py), the
examples (dataset.py, data.py), DeepSpeed's configuration (engine.py), the step loop (loop.py),
checkpoints (checkpoint.py), metrics and the summary (tracking.py), injected faults (faults.py).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

from toolkit.recipe.run_spec import RunSpec
from toolkit.runs import exits
from toolkit.runs.exits import RunEnds
from toolkit.runs.layout import RunLayout, RunSpecError
from toolkit.train import cores
from toolkit.watch import stacks
from toolkit.watch.progress import Reporter

_stop_requested = False


def request_stop(_signum, _frame) -> None:
    global _stop_requested
    _stop_requested = True


def logger(rank: int):
    def log(message: str) -> None:
        print(f"[rank {rank} {time.strftime('%H:%M:%S')}] {message}", flush=True)
    return log


def main() -> None:
    signal.signal(signal.SIGUSR2, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    # The watchdog's way to see where a hung rank is when py-spy is not installed.
    faulthandler.register(stacks.FAULTHANDLER_SIGNAL, all_threads=True)
    keep_to_planned_cores()
    layout = RunLayout(Path(os.environ["FT_RUN_DIR"]))
    try:
        train(layout, layout.read_spec())
    except RunSpecError as exc:
        ending = RunEnds(exits.USER_ERROR, f"{exc.message} ({exc.hint})")
    except RunEnds as caught:
        ending = caught
    else:
        return
    print(f"[rank {os.environ.get('RANK', '?')} {time.strftime('%H:%M:%S')}] {ending}", flush=True)
    layout.leave_exit_status(ending.code)  # every rank: whichever srun stops last
    sys.exit(ending.code)


def keep_to_planned_cores() -> None:
    """The cores the launcher planned for this rank, and thread pools as wide as OMP_NUM_THREADS (a
    rank forked from the warm template has the template's pools; a new process sized them from it)."""
    planned = cores.pin_to_planned_cores()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    if planned is not None:
        print(f"[rank {os.environ.get('RANK', '?')}] cores {cores.format_cpu_list(planned)}, "
              f"{threads or 'default'} thread(s)", flush=True)


# What train() imports, loaded ahead by the node's warm template (toolkit/launch/warm.py): a rank
# forked from it starts without the import time (5-12 s on the lab's CPUs). transformers loads a
# model's code only when asked for it: the Llama family's (the tiny model's, and most recipes').
PRELOAD = ("torch", "torch.distributed", "deepspeed", "peft", "transformers",
           "transformers.models.llama.modeling_llama", "toolkit.data.encode", "toolkit.storage.object_store",
           "toolkit.data.readers", "toolkit.train.checkpoint", "toolkit.train.compiled_ops",
           "toolkit.train.dataset", "toolkit.train.engine", "toolkit.train.evaluation", "toolkit.train.faults",
           "toolkit.train.loop", "toolkit.train.losses", "toolkit.train.models", "toolkit.train.objectives",
           "toolkit.train.packing", "toolkit.train.publish", "toolkit.train.snapshot", "toolkit.train.tracking")


def preload() -> None:
    import importlib

    for module in PRELOAD:
        importlib.import_module(module)


def train(layout: RunLayout, spec: RunSpec) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from toolkit.receipts import entries as receipt_entries
    from toolkit.recipe.run_spec import batch_plan
    from toolkit.train import compiled_ops
    from toolkit.train.checkpoint import END_UPLOAD_WAIT_S, STOP_UPLOAD_WAIT_S, checkpointer_for
    from toolkit.train.dataset import cache_root, load_eval_sets, load_examples, total_steps
    from toolkit.train.engine import deepspeed_config
    from toolkit.train.evaluation import Evaluator, Ranks
    from toolkit.train.faults import Faults
    from toolkit.train.loop import Loop
    from toolkit.train.models import resolve_model, trainable_model
    from toolkit.train.objectives import objective_for
    from toolkit.train.packing import fill, pack
    from toolkit.train.publish import publish
    from toolkit.train.tracking import Tracker, write_summary

    recipe = spec.recipe
    backend, site = spec.site.distributed_backend, spec.site
    shared_root = site.shared_root_of(layout.root)
    warn = lambda message: print(f"warning: {message}", flush=True)  # noqa: E731
    user_cache = cache_root(shared_root, layout.root, warn)
    compiled_ops.prepare(user_cache, warn)
    compiled_ops.share_inductor_cache(user_cache)
    if backend == "nccl":
        # Each rank takes the GPU its LOCAL_RANK names before the first collective (the barrier in
        # load_examples); otherwise torch guesses one from the global rank, which can hang.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend=backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    log = logger(rank)
    if world != spec.derived.world_size:  # the batch arithmetic holds for the planned ranks only
        raise RunEnds(exits.USER_ERROR, f"{world} ranks started, but the recipe was planned for "
                                        f"{spec.derived.world_size}: render the job script again for this allocation")
    tracker = Tracker(layout, recipe, rank)  # W&B starts beside the model load (tracking.py)
    faults = Faults.from_env()
    plan = batch_plan(recipe.training, world, faults.out_of_memory_retry)
    torch.manual_seed(recipe.training.seed)
    model_path = resolve_model(recipe.model.base, recipe.model.revision, shared_root, user_cache,
                               site.s3_models, log)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    # On a GPU under ZeRO-0/1/2 the weights load straight onto the rank's device (ZeRO-3 partitions
    # them in DeepSpeed); the decoder layers are compiled where the recipe leaves it open (models.py).
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    compiled = recipe.training.compiled(on_gpu=device is not None)
    # Under ZeRO-3 each parameter is partitioned as it loads (the configuration's schedule is the
    # engine's business, later: only its ZeRO and precision sections shape the loading).
    zero3 = deepspeed_config(recipe.training, plan, 1) if recipe.training.zero_stage == 3 else None
    model = trainable_model(model_path, recipe.method, recipe.training,
                            device if recipe.training.zero_stage != 3 else None, compiled, zero3)
    if compiled:
        log("decoder layers compiled (torch.compile): the first steps include the compilation")
    objective = objective_for(recipe.objective)
    units = objective.units(load_examples(recipe, model_path, user_cache, rank, dist, log))
    if recipe.packed:
        examples = len(units)
        units = pack(units, recipe.data.max_seq_len)
        full = fill(units, recipe.data.max_seq_len)
        per_step = recipe.training.global_batch * full * recipe.data.max_seq_len
        log(f"packed {examples} examples into {len(units)} rows of up to {recipe.data.max_seq_len} tokens "
            f"({full:.0%} full): a step of {recipe.training.global_batch} rows "
            f"trains about {per_step:,.0f} tokens ({examples / max(1, len(units)):.1f} examples a row)")
    steps = total_steps(recipe, len(units))
    tracker.total_steps = steps
    engine, _, _, _ = deepspeed.initialize(model=model, config=deepspeed_config(recipe.training, plan, steps),
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    progress = Reporter()
    checkpointer = checkpointer_for(layout, spec, engine, dist, progress, log, faults.checkpoint_file)
    start = checkpointer.resume()
    evaluator = None
    if recipe.eval.enabled:
        evaluator = Evaluator(layout, recipe, engine, objective, tokenizer,
                              load_eval_sets(recipe, model_path, user_cache, rank, dist, log),
                              Ranks(dist, rank, world, engine.device), plan.micro_batch, progress, log)
        evaluator.base_before(start)
    loop = Loop(engine, dist, rank, world, recipe, plan, units, objective, tokenizer.pad_token_id, tracker,
                checkpointer, progress, faults, log, lambda: _stop_requested, backend)
    started = time.monotonic()
    try:
        step = loop.run(start, steps)
    except RunEnds as ending:
        together = ending.code == exits.STOPPED  # every rank stops at the same step
        checkpointer.close(STOP_UPLOAD_WAIT_S, together=together)  # the last checkpoint written whole
        if together:
            tracker.finish()
        raise
    progress.report("export", step)
    export(engine, tokenizer, layout, rank)  # while the last checkpoint is written in the background
    evaluation = evaluator.after(step) if evaluator else None
    checkpointer.close(END_UPLOAD_WAIT_S)
    timing = {"wall_seconds": round(time.monotonic() - started, 2),
              "checkpoint_seconds": round(checkpointer.seconds, 2), "checkpoints": checkpointer.written,
              "checkpoint_write_seconds": round(checkpointer.writer.write_seconds, 2)}
    if engine.device.type == "cuda":  # rank 0's, against the memory plan's estimate
        timing["peak_device_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if rank == 0:
        published = time.monotonic()
        publish(layout, recipe, evaluation, step, log)  # the registry, the receipt's last entry
        timing |= {"eval_seconds": evaluation["seconds"] if evaluation else 0.0,
                   "publish_seconds": round(time.monotonic() - published, 2),
                   "receipt_seconds": round(receipt_entries.spent_seconds, 3)}  # rank 0's, this start's
        write_summary(layout, recipe, step, loop.tokens * world, timing)
        if evaluation:
            tracker.evaluation(evaluation)
        tracker.artifact(layout.output)
        log(f"wrote {layout.output} and {layout.summary.name}")
    dist.barrier()
    tracker.finish()


def export(engine, tokenizer, layout: RunLayout, rank: int) -> None:
    """The adapter (LoRA) or the consolidated weights (full), in safetensors, with the tokenizer.
    Under ZeRO-3 the parameters are sharded: every rank joins the gather, rank 0 writes."""
    import deepspeed

    parameters = list(engine.module.parameters())
    sharded = engine.zero_optimization_stage() == 3
    with deepspeed.zero.GatheredParameters(parameters, modifier_rank=None, enabled=sharded):
        if rank == 0:
            layout.output.mkdir(exist_ok=True)
            engine.module.save_pretrained(layout.output, safe_serialization=True, is_main_process=True)
    if rank == 0:
        tokenizer.save_pretrained(layout.output)

if __name__ == "__main__":
    main()
