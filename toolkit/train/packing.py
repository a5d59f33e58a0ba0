"""Sequence packing: the training examples laid end to end in rows of up to `max_seq_len` tokens, so
a batch of mostly short chats spends its compute on tokens, not on padding.

Each packed row keeps its examples apart: its position ids restart at 0 with each example, and
transformers builds the attention mask from them (no attention mask is passed; see
`transformers.masking_utils.find_packed_sequence_indices`): a token attends only to the earlier
tokens of its own example, as unpacked. The first label of each example is ignored, so the last token
of one example is never trained to predict the first of the next; unpacked, that label is never
predicted either (the loss shifts labels left by one), so each example's loss is its unpacked loss.

Rows are filled best-fit-decreasing (the longest examples first, each into the fullest row it fits),
a pure function of the examples: a resumed run packs the same rows.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from toolkit.train.data import IGNORE, Example


def pack(examples: list[Example], max_len: int) -> list[Example]:
    """The examples packed into rows of at most max_len tokens (an example longer than that has a
    row of its own: the data gate truncates or refuses those before)."""
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i].input_ids), i))
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (tokens left, row), ascending: the fullest row that fits first
    for index in order:
        length = len(examples[index].input_ids)
        at = bisect_left(room, (length, -1))
        if at < len(room):
            left, row = room.pop(at)
            rows[row].append(index)
            insort(room, (left - length, row))
        else:
            rows.append([index])
            insort(room, (max_len - length, len(rows) - 1))
    return [joined([examples[i] for i in sorted(row)]) for row in rows]


def joined(parts: list[Example]) -> Example:
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    for part in parts:
        ids += part.input_ids
        labels += [IGNORE] + part.labels[1:]
        positions += range(len(part.input_ids))
    return Example(ids, labels, positions)


def fill(rows: list[Example], max_len: int) -> float:
    """The share of the rows' room that holds tokens."""
    return sum(len(row.input_ids) for row in rows) / (max_len * len(rows)) if rows else 0.0
