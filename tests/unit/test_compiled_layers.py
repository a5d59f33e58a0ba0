"""Regional torch.compile of the decoder layers (toolkit/train/models.py), on a tiny random Llama
built here with inductor on this CPU: the same losses as eager, sequences of varying length (a
padded batch's length changes each step), and when it is on by default."""

from __future__ import annotations

import pytest

from tests.support.tiny_peft import Engine
from toolkit.recipe.schema import MethodSpec, TrainingSpec
from toolkit.train.models import trainable_model

torch = pytest.importorskip("torch")


def train_a_few_steps(folder, compiled: bool) -> list[float]:
    from toolkit.train.losses import causal_lm_loss

    torch.manual_seed(0)
    method = MethodSpec(kind="lora", rank=4, alpha=8, dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = trainable_model(folder, method, TrainingSpec(precision="fp32"), None, compiled)
    assert not model.config.use_cache  # HF's cache is for generation; under compile it recompiled per layer
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for length in (5, 9):
        ids = (torch.arange(length) % 60 + 3)[None]
        loss = causal_lm_loss(Engine(model), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    layers = model.get_base_model().get_decoder().layers
    assert all((layer._compiled_call_impl is not None) == compiled for layer in layers)
    assert all("_orig_mod" not in name for name in model.state_dict())  # checkpoints keep their keys
    return losses


def test_compiled_layers_train_as_eager_ones(tmp_path):
    from toolkit.train.tiny import build_model

    build_model(tmp_path, vocab_size=64, hidden=32, layers=2)
    eager = train_a_few_steps(tmp_path, compiled=False)
    compiled = train_a_few_steps(tmp_path, compiled=True)
    assert compiled == pytest.approx(eager, abs=1e-5)
    assert eager[1] != eager[0]  # the second step trained on what the first learnt


def test_compile_is_on_for_gpus_by_default_and_never_under_zero_3():
    assert TrainingSpec().compiled(on_gpu=True) and not TrainingSpec().compiled(on_gpu=False)
    assert TrainingSpec(compile=True).compiled(on_gpu=False)
    assert not TrainingSpec(compile=False).compiled(on_gpu=True)
    assert not TrainingSpec(zero_stage=3).compiled(on_gpu=True)
    with pytest.raises(ValueError, match="compile: true is not offered with zero_stage: 3"):
        TrainingSpec(compile=True, zero_stage=3)
