"""Sequence packing (toolkit/train/packing.py) on a tiny random Llama built here: each example's loss
in a packed row equals its loss alone, the rows hold every token once, and when packing is on."""

from __future__ import annotations

import pytest

from tests.support.tiny_peft import Engine, lora_model
from toolkit.recipe.schema import Recipe
from toolkit.train.data import IGNORE, Example, collate
from toolkit.train.packing import fill, pack

torch = pytest.importorskip("torch")

EXAMPLES = [Example([1, 2, 3, 4, 5], [IGNORE, IGNORE, 3, 4, 5]),  # a prompt of two, then the answer
            Example([6, 7, 8], [6, 7, 8]),  # text: every token labelled (the first predicts nothing)
            Example([9, 10, 11, 12], [IGNORE, 10, 11, 12]),
            Example([13, 14], [IGNORE, 14])]


def token_losses(model, batch):
    """Per position: the loss of predicting its label from the previous position (0 where ignored).
    Without HF's KV cache, as ft trains: with one, transformers does not look for packed rows."""
    from toolkit.train.losses import model_inputs

    logits = model(**model_inputs(batch), use_cache=False).logits.float()
    targets = batch["labels"][:, 1:]
    losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), targets.clamp(min=0), reduction="none")
    return torch.nn.functional.pad(losses * (targets != IGNORE), (1, 0))


def test_each_examples_loss_packed_equals_its_loss_alone(tmp_path):
    model = lora_model(tmp_path).eval()
    rows = pack(EXAMPLES, max_len=8)
    assert len(rows) == 2 and fill(rows, 8) == 14 / 16
    with torch.no_grad():
        packed = token_losses(model, collate(rows, pad_id=0))
        for row, example_row in enumerate(rows):
            start = 0
            for length in segment_lengths(example_row):
                part = example_row.input_ids[start:start + length]
                alone = next(e for e in EXAMPLES if e.input_ids == part)
                single = token_losses(model, collate([alone], pad_id=0))[0]
                assert torch.allclose(packed[row, start:start + length], single, atol=1e-4)
                assert single.sum() > 0  # something was compared
                start += length


def test_the_loss_of_a_packed_batch_is_the_mean_over_its_examples_tokens(tmp_path):
    from toolkit.train.losses import causal_lm_loss

    model = lora_model(tmp_path).eval()
    with torch.no_grad():
        packed = causal_lm_loss(Engine(model), collate(pack(EXAMPLES, 8), pad_id=0))
        per_token = torch.cat([token_losses(model, collate([e], pad_id=0))[0][1:] for e in EXAMPLES])
        labelled = sum(sum(label != IGNORE for label in e.labels[1:]) for e in EXAMPLES)
    assert torch.allclose(packed, per_token.sum() / labelled, atol=1e-5)


def segment_lengths(row: Example) -> list[int]:
    starts = [i for i, position in enumerate(row.position_ids) if position == 0] + [len(row.position_ids)]
    return [b - a for a, b in zip(starts, starts[1:], strict=False)]


def test_rows_hold_every_token_once_and_never_predict_across_examples():
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (200,), generator=generator).tolist()
    examples = [Example(list(range(n)), list(range(n))) for n in lengths]
    rows = pack(examples, max_len=64)
    assert all(len(row.input_ids) <= 64 for row in rows)
    assert sorted(n for row in rows for n in segment_lengths(row)) == sorted(lengths)
    assert fill(rows, 64) > 0.95  # best-fit decreasing on short examples leaves little room
    for row in rows:  # the first label of each example carries no loss
        assert all(row.labels[i] == IGNORE for i, p in enumerate(row.position_ids) if p == 0)
    assert pack(examples, 64) == rows  # a pure function of the examples: a resumed run packs the same


def test_padding_after_a_packed_row_is_a_sequence_of_its_own():
    batch = collate(pack([Example([1, 2, 3], [1, 2, 3]), Example([4, 5], [4, 5])], max_len=3), pad_id=0)
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 1, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 2, 3], [IGNORE, 5, IGNORE]]
    assert batch["attention_mask"].sum() == 5  # the tokens the loop counts


def recipe(**data):
    return Recipe.model_validate({"name": "r", "model": {"base": "tiny-llama"}, "data": {"train": "t.jsonl", **data}})


def test_packing_is_on_for_sft_off_for_dpo_and_refused_for_dpo():
    assert recipe().packed and not recipe(packing=False).packed
    dpo = Recipe.model_validate({"name": "r", "model": {"base": "tiny-llama"}, "data": {"train": "t.jsonl"},
                                 "objective": {"kind": "dpo"}})
    assert not dpo.packed
    with pytest.raises(ValueError, match="DPO compares each chosen answer with its rejected one"):
        Recipe.model_validate({"name": "r", "model": {"base": "tiny-llama"},
                               "data": {"train": "t.jsonl", "packing": True}, "objective": {"kind": "dpo"}})
