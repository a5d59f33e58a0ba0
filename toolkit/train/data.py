"""Batches for the workers, in an order that is a pure function of (seed, step), so a resumed run
sees exactly the batches an uninterrupted one would. (Tokenization: toolkit.data.encode.)"""

from __future__ import annotations

from dataclasses import dataclass

IGNORE = -100  # label of tokens that carry no loss (prompt, user turns, padding)


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]
    position_ids: list[int] | None = None  # a packed row's (toolkit/train/packing.py): restart per example


def batch_indices(step: int, seed: int, dataset_size: int, global_batch: int) -> list[int]:
    """The examples of a global step: a fresh permutation per epoch, all from (seed, step) alone."""
    import torch

    indices = []
    position = step * global_batch
    while len(indices) < global_batch:
        epoch, offset = divmod(position, dataset_size)
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        order = torch.randperm(dataset_size, generator=generator).tolist()
        take = min(global_batch - len(indices), dataset_size - offset)
        indices += order[offset: offset + take]
        position += take
    return indices


def rank_slice(indices: list[int], rank: int, world: int, micro_batch: int, micro_step: int) -> list[int]:
    """This rank's micro batch `micro_step` of a global batch (ranks interleave by micro batch)."""
    start = (micro_step * world + rank) * micro_batch
    return indices[start: start + micro_batch]


def collate(examples: list[Example], pad_id: int):
    import torch

    length = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, example in enumerate(examples):
        ids[row, : len(example.input_ids)] = torch.tensor(example.input_ids)
        labels[row, : len(example.labels)] = torch.tensor(example.labels)
        mask[row, : len(example.input_ids)] = 1
    batch = {"input_ids": ids, "labels": labels, "attention_mask": mask}
    if any(example.position_ids is not None for example in examples):
        # Packed rows: the padding after a row is one more sequence of its own (positions from 0), so
        # it joins no example; the model gets these positions and no attention mask (losses.py).
        positions = torch.zeros((len(examples), length), dtype=torch.long)
        for row, example in enumerate(examples):
            used = len(example.input_ids)
            positions[row, :used] = torch.tensor(example.position_ids or list(range(used)))
            positions[row, used:] = torch.arange(length - used)
        batch["position_ids"] = positions
    return batch
