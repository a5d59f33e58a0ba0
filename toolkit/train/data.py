"""Training data for the workers: read, tokenize with the loss on the right tokens, and batch in an
order that is a pure function of (seed, step), so a resumed run sees exactly the batches an
uninterrupted one would."""

from __future__ import annotations

import json
from dataclasses import dataclass

IGNORE = -100  # label of tokens that carry no loss (prompt, user turns, padding)


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]


def read_jsonl(url: str) -> list[dict]:
    """Rows of a JSONL file, local or s3:// (through fsspec)."""
    import fsspec

    rows = []
    with fsspec.open(url, "rt", encoding="utf-8", compression="infer") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{url}:{number}: not JSON ({exc.msg}); run `ft validate` first") from None
    return rows


def detect_format(row: dict) -> str:
    if "messages" in row:
        return "chat"
    if {"chosen", "rejected"} <= row.keys():
        return "preference"
    if {"prompt", "completion"} <= row.keys():
        return "prompt_completion"
    raise ValueError(f"unknown data format: a row has keys {sorted(row)}")


def sft_example(row: dict, tokenizer, max_len: int, fmt: str) -> Example:
    """Tokens of one SFT example; labels keep only the completion / assistant tokens."""
    if fmt == "prompt_completion":
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = [tokenizer.bos_token_id, *prompt, *completion]
        labels = [IGNORE] * (1 + len(prompt)) + completion
    else:
        ids, labels = [], []
        for turn in range(len(row["messages"])):
            # The template renders a prefix of the conversation; the new tokens belong to this turn.
            text = tokenizer.apply_chat_template(row["messages"][: turn + 1], tokenize=False)
            prefix = tokenizer(text, add_special_tokens=False)["input_ids"]
            new = prefix[len(ids):]
            ids = prefix
            labels += new if row["messages"][turn]["role"] == "assistant" else [IGNORE] * len(new)
    return Example(ids[:max_len], labels[:max_len])


def preference_example(row: dict, tokenizer, max_len: int) -> tuple[Example, Example]:
    """(chosen, rejected) sequences sharing the prompt; labels on the responses only."""
    prompt = [tokenizer.bos_token_id, *tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]]
    pair = []
    for key in ("chosen", "rejected"):
        response = tokenizer(row[key], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        pair.append(Example((prompt + response)[:max_len], ([IGNORE] * len(prompt) + response)[:max_len]))
    return pair[0], pair[1]


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
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}
