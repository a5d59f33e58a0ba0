"""DeepSpeed's configuration from the recipe (toolkit/train/engine.py), read back by DeepSpeed's own
parser: what ft asks for is what DeepSpeed runs."""

from __future__ import annotations

import pytest

from toolkit.recipe.run_spec import batch_plan
from toolkit.recipe.schema import TrainingSpec
from toolkit.train.engine import deepspeed_config

pytest.importorskip("deepspeed")


def parsed(training: TrainingSpec):
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig(deepspeed_config(training, batch_plan(training, 1), total_steps=10))


def test_bf16_runs_without_the_per_parameter_overflow_check():
    """bf16 has fp32's range and no loss scale: the check only cost launches (GPU.md); a non-finite
    gradient norm stops the run in the loop instead."""
    config = parsed(TrainingSpec(precision="bf16", global_batch=1, zero_stage=2))
    assert config.bfloat16_config.enabled and config.bfloat16_config.check_grad_overflow is False
    assert config.gradient_clipping == 1.0  # the norm the loop checks is computed


def test_fp16_keeps_dynamic_loss_scaling():
    config = parsed(TrainingSpec(precision="fp16", global_batch=1, zero_stage=2))
    assert config.float16_config.enabled and not config.bfloat16_config.enabled
    assert config.float16_config.loss_scale == 0  # 0: dynamic, which skips the steps that overflow


def test_zero_1_registers_no_hook_per_gradient():
    """Adapters' ZeRO-1: no per-tensor gradient hook (the host cost GPU.md measured); stage 2 keeps
    DeepSpeed's overlap of reduction and backward."""
    one = parsed(TrainingSpec(precision="bf16", global_batch=1, zero_stage=1))
    assert one.zero_optimization_stage == 1
    assert not one.zero_config.contiguous_gradients and not one.zero_config.overlap_comm
    two = parsed(TrainingSpec(precision="bf16", global_batch=1, zero_stage=2))
    assert two.zero_config.contiguous_gradients  # DeepSpeed's default, left alone
