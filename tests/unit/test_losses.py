"""The loss without the whole vocabulary's logits (toolkit/train/losses.py) against transformers' own,
on tiny random Llamas built here: equal losses and equal gradients, LoRA and full fine-tuning."""

from __future__ import annotations

import pytest

from tests.support.tiny_peft import Engine, lora_model
from toolkit.train import losses
from toolkit.train.data import IGNORE, Example, collate

torch = pytest.importorskip("torch")


def batch_of(*rows):
    return collate([Example(ids, labels) for ids, labels in rows], pad_id=0)


ROWS = (([1, 2, 3, 4, 5, 6], [IGNORE, IGNORE, 3, 4, 5, 6]),  # a prompt of two, then the completion
        ([7, 8, 9], [IGNORE, 8, 9]))  # shorter: padded, its padding ignored


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 3 rows at the tiny vocabulary (64): a micro batch spans several chunks, one partial."""
    monkeypatch.setattr(losses.memory_plan, "CHUNK_LOGITS_BYTES", 3 * 4 * 64)
    assert losses.chunk_rows(64) == 3


def trainable_grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad and p.grad is not None}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_loss_and_gradients_equal_transformers_own(tmp_path, small_chunks, dtype):
    model = lora_model(tmp_path).to(getattr(torch, dtype))
    batch = batch_of(*ROWS)
    expected = model(**batch).loss
    expected.backward()
    wanted = trainable_grads(model)
    model.zero_grad(set_to_none=True)

    loss = losses.causal_lm_loss(Engine(model), batch)
    loss.backward()
    got = trainable_grads(model)
    tolerance = 1e-4 if dtype == "float32" else 2e-2
    assert loss.dtype == torch.float32
    assert torch.allclose(loss, expected.float(), atol=tolerance, rtol=0)
    assert got.keys() == wanted.keys() and len(got) == 4  # lora_A and lora_B of q_proj and v_proj
    for name in wanted:
        assert torch.allclose(got[name].float(), wanted[name].float(), atol=tolerance, rtol=tolerance), name


def test_full_fine_tuning_gets_the_heads_gradient(tmp_path, small_chunks):
    from transformers import AutoModelForCausalLM

    from toolkit.train.tiny import build_model

    build_model(tmp_path, vocab_size=64, hidden=32, layers=1)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, tie_word_embeddings=False)
    batch = batch_of(*ROWS)
    model(**batch).loss.backward()
    wanted = trainable_grads(model)
    model.zero_grad(set_to_none=True)
    losses.causal_lm_loss(Engine(model), batch).backward()
    got = trainable_grads(model)
    assert "lm_head.weight" in got and got.keys() == wanted.keys()
    for name in wanted:
        assert torch.allclose(got[name], wanted[name], atol=1e-5, rtol=1e-4), name


def test_a_gradient_scale_from_outside_reaches_every_gradient(small_chunks):
    """fp16's loss scaling multiplies the loss's gradient: the saved gradients follow it."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 8, generator=generator, requires_grad=True)
    weight = torch.randn(64, 8, generator=generator, requires_grad=True)
    labels = torch.randint(0, 64, (2, 5), generator=generator)
    labels[0, :2] = IGNORE
    reference = torch.nn.functional.cross_entropy(
        (hidden @ weight.T)[:, :-1].reshape(-1, 64), labels[:, 1:].reshape(-1), ignore_index=IGNORE)
    (reference * 128).backward()
    wanted = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    loss = losses.linear_cross_entropy(hidden, weight, labels)
    (loss * 128).backward()
    assert torch.allclose(loss, reference, atol=1e-6)
    assert torch.allclose(hidden.grad, wanted[0], atol=1e-4) and torch.allclose(weight.grad, wanted[1], atol=1e-4)


def test_a_micro_batch_with_nothing_labelled_learns_nothing(small_chunks):
    hidden = torch.randn(1, 4, 8, requires_grad=True)
    weight = torch.randn(64, 8)
    loss = losses.linear_cross_entropy(hidden, weight, torch.full((1, 4), IGNORE))
    loss.backward()
    assert loss.item() == 0.0 and torch.count_nonzero(hidden.grad) == 0


def test_under_zero_3_the_loss_is_transformers_own(tmp_path):
    """ZeRO-3 partitions the head's weight (an empty tensor outside the head's own forward): ft's loss
    cannot read it, so the model makes its logits as before."""
    model = lora_model(tmp_path)
    batch = batch_of(*ROWS)

    class Zero3(Engine):
        def zero_optimization_stage(self) -> int:
            return 3

    head = model.get_output_embeddings()
    whole = head.weight.data
    head.weight.data = torch.empty(0)  # what a rank holds of it under ZeRO-3
    try:
        with torch.no_grad():
            head.weight.data = whole
            expected = model(**batch).loss
            head.weight.data = torch.empty(0)
            calls = []

            def gather(module, _args):  # as ZeRO-3's hook before the head's forward
                calls.append(module)
                module.weight.data = whole

            head.register_forward_pre_hook(gather)
            loss = losses.causal_lm_loss(Zero3(model), batch)
    finally:
        head.weight.data = whole
    assert calls and torch.allclose(loss, expected)


def test_only_a_plain_head_in_bf16_or_fp32_takes_the_chunked_loss(tmp_path):
    """Anything else than logits = hidden @ weight.T gets transformers' own loss: soft-capped or
    scaled logits, adapters on the head, fp16 (its loss scale must reach the logits' gradient)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from toolkit.train.tiny import build_model

    model = lora_model(tmp_path / "a")
    head = model.get_output_embeddings()
    assert losses.plain_head(Engine(model), head)
    model.config.final_logit_softcapping = 30.0  # Gemma 2's
    assert not losses.plain_head(Engine(model), head)
    model.config.final_logit_softcapping = None
    assert not losses.plain_head(Engine(model.half()), head)  # fp16

    build_model(tmp_path / "b", vocab_size=64, hidden=32, layers=1)
    adapted = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "b"),
                             LoraConfig(r=4, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM"))
    assert not losses.plain_head(Engine(adapted), adapted.get_output_embeddings())
    batch = batch_of(*ROWS)
    assert torch.allclose(losses.causal_lm_loss(Engine(adapted), batch), adapted(**batch).loss)
