"""The objectives on a tiny random Llama (built here, no hub): SFT's loss is the model's own, DPO's
log-probabilities and loss are the ones its formula gives."""

from __future__ import annotations

import math

import pytest

from tests.support.tiny_peft import Engine, lora_model
from toolkit.recipe.schema import ObjectiveSpec
from toolkit.train.data import IGNORE, Example, collate
from toolkit.train.objectives import Dpo, Sft, objective_for, sequence_logps

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return lora_model(tmp_path_factory.mktemp("tiny")).eval()


def test_sequence_logps_sums_the_labelled_tokens_only():
    logits = torch.log_softmax(torch.randn(1, 4, 5, generator=torch.Generator().manual_seed(0)), -1)
    labels = torch.tensor([[IGNORE, 2, IGNORE, 4]])  # token 0 predicts nothing; 2 and 4 are labelled
    expected = logits[0, 0, 2] + logits[0, 2, 4]
    assert torch.allclose(sequence_logps(logits, labels), expected.unsqueeze(0))


def test_sft_loss_is_the_models_own(model):
    batch = collate([Example([1, 2, 3, 4], [IGNORE, 2, 3, 4])], pad_id=0)
    loss, accuracy = Sft().loss(Engine(model), batch)
    assert accuracy is None
    assert torch.allclose(loss, model(**batch).loss)
    assert isinstance(objective_for(ObjectiveSpec()), Sft)


def test_dpo_pairs_chosen_then_rejected_and_starts_at_log_2(model):
    chosen, rejected = Example([1, 2, 3, 4], [IGNORE, 2, 3, 4]), Example([1, 2, 5, 6], [IGNORE, 2, 5, 6])
    dpo = objective_for(ObjectiveSpec(kind="dpo", beta=0.1))
    assert isinstance(dpo, Dpo) and dpo.beta == 0.1
    units = dpo.units([chosen, rejected, rejected, chosen])
    assert units == [(chosen, rejected), (rejected, chosen)]
    rows = dpo.micro_batch(units)
    assert rows == [chosen, rejected, rejected, chosen]  # every chosen first, then the rejected ones

    # LoRA's B matrices start at zero: the policy is its own reference, every margin is 0.
    loss, accuracy = dpo.loss(Engine(model), collate(rows, pad_id=0))
    assert math.isclose(loss.item(), math.log(2), rel_tol=1e-5)
    assert accuracy.item() == 0.0

    for name, parameter in model.named_parameters():  # move the policy away from its reference
        if "lora_B" in name:
            parameter.data.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
    batch, sharp = collate(rows, pad_id=0), Dpo(beta=10.0)
    loss, accuracy = sharp.loss(Engine(model), batch)
    with torch.no_grad():
        policy = sequence_logps(model(**{k: batch[k] for k in ("input_ids", "attention_mask")}).logits, batch["labels"])
        with model.disable_adapter():
            reference = sequence_logps(model(input_ids=batch["input_ids"],
                                             attention_mask=batch["attention_mask"]).logits, batch["labels"])
    margins = (policy[:2] - reference[:2]) - (policy[2:] - reference[2:])
    assert math.isclose(loss.item(), -torch.nn.functional.logsigmoid(10.0 * margins).mean().item(), rel_tol=1e-5)
    assert accuracy.item() == (margins > 0).float().mean().item()
    assert abs(loss.item() - math.log(2)) > 1e-3  # the margins moved it
