"""Rows to training tokens, the one way both validation (login node) and the workers do it:
labels keep the loss on the completion / assistant tokens only."""

from __future__ import annotations

from typing import Any

from toolkit.data.tokenizer import LengthCounter

IGNORE = -100


def encode_rows(rows: list[dict[str, Any]], fmt: str, tok: LengthCounter,
                max_len: int) -> list[tuple[list[int], list[int], int]]:
    """(input ids, labels, untruncated length) per row; ids and labels cut to max_len."""
    if fmt == "prompt_completion":
        prompts = tok.ids([row["prompt"] for row in rows])
        completions = tok.ids([row["completion"] for row in rows])
        out = []
        for prompt, completion in zip(prompts, completions, strict=True):
            ids = [tok.bos_id, *prompt, *completion, tok.eos_id]
            labels = [IGNORE] * (1 + len(prompt)) + [*completion, tok.eos_id]
            out.append((ids[:max_len], labels[:max_len], len(ids)))
        return out
    if fmt == "chat":
        return [_chat(row["messages"], tok, max_len) for row in rows]
    raise ValueError(f"{fmt} data has no single-sequence encoding")


def _chat(messages: list[dict], tok: LengthCounter, max_len: int) -> tuple[list[int], list[int], int]:
    ids: list[int] = []
    labels: list[int] = []
    for turn in range(len(messages)):
        # The template renders a prefix of the conversation; the new tokens belong to this turn.
        prefix = tok.ids([tok.render_chat(messages[: turn + 1])])[0]
        new = prefix[len(ids):]
        ids = prefix
        labels += new if messages[turn]["role"] == "assistant" else [IGNORE] * len(new)
    return ids[:max_len], labels[:max_len], len(ids)
