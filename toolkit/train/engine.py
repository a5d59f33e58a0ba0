"""DeepSpeed for one rank: its configuration from the typed recipe and the batch plan, and the
per-step seeding that makes a resumed run repeat the uninterrupted one."""

from __future__ import annotations

from toolkit.recipe.run_spec import BatchPlan
from toolkit.recipe.schema import TrainingSpec


def deepspeed_config(training: TrainingSpec, plan: BatchPlan, total_steps: int) -> dict:
    warmup = max(1, training.warmup_steps)  # DeepSpeed's schedulers refuse 0
    schedulers = {
        "cosine": {"type": "WarmupCosineLR", "params": {"total_num_steps": total_steps,
                                                        "warmup_num_steps": warmup}},
        "linear": {"type": "WarmupDecayLR", "params": {"total_num_steps": total_steps, "warmup_min_lr": 0,
                                                       "warmup_max_lr": training.learning_rate,
                                                       "warmup_num_steps": warmup}},
        "constant": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": training.learning_rate,
                                                    "warmup_num_steps": warmup}},
    }
    config = {
        "train_batch_size": training.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.gradient_accumulation,
        "gradient_clipping": training.max_grad_norm,
        # torch's AdamW: DeepSpeed's fused/CPU Adam would compile an op on first use.
        "optimizer": {"type": "AdamW", "params": {"lr": training.learning_rate, "torch_adam": True,
                                                  "weight_decay": 0.0}},
        "scheduler": schedulers[training.lr_schedule],
        "zero_optimization": zero_config(training.zero_stage),
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if training.precision == "bf16":
        # bf16 needs no loss scaling, so nothing to skip a step for; DeepSpeed's overflow check is
        # per parameter (~1000 small kernels a step for LoRA on an 8B model: host-bound on a GPU).
        # A NaN loss stops the run in the loop instead (exit 4).
        config["bf16"] = {"enabled": True, "check_grad_overflow": False}
    elif training.precision == "fp16":
        config["fp16"] = {"enabled": True}
    return config


def zero_config(stage: int) -> dict:
    """ZeRO-1 without contiguous gradients registers no hook on the parameters: the gradients are
    reduced in flat buckets at the accumulation boundary. DeepSpeed's default for stage 1 (contiguous
    gradients on) copies each gradient into a bucket from a hook as the backward makes it: for
    LoRA's 448 small tensors on an 8B model that host work was 8% of a GPU step (GPU.md), and on
    this machine's proxy ZeRO-1 so matched the bare loop (114-124 ms a step against 113-115; stage
    2: 131-139). Stage 2 keeps DeepSpeed's defaults: it overlaps the reduction of large gradients
    with the backward, which full fine-tuning needs."""
    if stage == 1:
        return {"stage": 1, "contiguous_gradients": False, "overlap_comm": False}
    return {"stage": stage}


def seed_step(seed: int, device) -> None:
    """Dropout and every other random draw of a step follow from (seed, step, rank): a resumed run
    repeats exactly what the uninterrupted one would have done. Only the generators a step draws
    from are seeded (the host's and the rank's GPU): torch.manual_seed seeds every backend torch
    knows (CUDA, XPU, MTIA, MPS) and cost 1.5 ms a step on the CPU here (cProfile, a 64x2 model)."""
    import torch

    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)  # the current device: set to LOCAL_RANK's at start


def step_seed(seed: int, step: int, rank: int) -> int:
    return seed * 1_000_003 + step * 4099 + rank
