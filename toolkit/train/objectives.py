"""What a step optimises: SFT (the model's own loss on the labelled tokens) or DPO. An objective
arranges the training examples into its units, lays a micro batch out, and computes its loss."""

from __future__ import annotations

from typing import Protocol

from toolkit.recipe.schema import ObjectiveSpec
from toolkit.train.data import Example
from toolkit.train.losses import causal_lm_loss


class Objective(Protocol):
    def units(self, examples: list[Example]) -> list:
        """What a batch index picks: an example (SFT), or a (chosen, rejected) pair (DPO)."""

    def micro_batch(self, units: list) -> list[Example]:
        """The rows of a micro batch, in the order `loss` expects."""

    def loss(self, engine, batch: dict):
        """(loss, accuracy or None) of one micro batch already on the rank's device."""

    def unit_losses(self, engine, batch: dict):
        """Per unit of a micro batch, for evaluation: (loss summed over the unit, what it is summed
        over: labelled tokens or 1 per pair, accuracy or None)."""


class Sft:
    def units(self, examples: list[Example]) -> list[Example]:
        return examples

    def micro_batch(self, units: list[Example]) -> list[Example]:
        return units

    def loss(self, engine, batch: dict):
        return causal_lm_loss(engine, batch), None  # without the whole vocabulary's logits

    def unit_losses(self, engine, batch: dict):
        logits = engine(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        tokens = (batch["labels"][:, 1:] != -100).sum(-1)
        return -sequence_logps(logits.float(), batch["labels"]), tokens, None  # fp32: bf16 sums drift


def sequence_logps(logits, labels):
    """Sum of the log-probabilities of each sequence's labelled tokens."""
    import torch

    shifted_logits, shifted_labels = logits[:, :-1, :], labels[:, 1:]
    mask = shifted_labels != -100
    gathered = torch.gather(shifted_logits.log_softmax(-1), 2, shifted_labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (gathered * mask).sum(-1)


class Dpo:
    """DPO on a batch holding the chosen sequences, then the rejected ones. The reference model is
    the base model itself: the policy with its LoRA adapters switched off."""

    def __init__(self, beta: float):
        self.beta = beta

    def units(self, examples: list[Example]) -> list[tuple[Example, Example]]:
        return list(zip(examples[0::2], examples[1::2], strict=True))  # validation writes them in pairs

    def micro_batch(self, units: list[tuple[Example, Example]]) -> list[Example]:
        return [pair[0] for pair in units] + [pair[1] for pair in units]

    def loss(self, engine, batch: dict):
        losses, _, accuracies = self.unit_losses(engine, batch)
        return losses.mean(), accuracies.mean()

    def unit_losses(self, engine, batch: dict):
        import torch
        import torch.nn.functional as F

        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        logps = sequence_logps(engine(**inputs).logits, batch["labels"])
        with torch.no_grad(), engine.module.disable_adapter():
            reference = sequence_logps(engine.module(**inputs).logits, batch["labels"])
        half = logps.shape[0] // 2
        chosen, rejected = logps[:half] - reference[:half], logps[half:] - reference[half:]
        losses = -F.logsigmoid(self.beta * (chosen - rejected))
        return losses, torch.ones_like(losses), (chosen > rejected).float()


def objective_for(spec: ObjectiveSpec) -> Objective:
    return Dpo(spec.beta) if spec.kind == "dpo" else Sft()
