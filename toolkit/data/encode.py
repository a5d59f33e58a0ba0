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
        # One call for both halves: the tokenizer spreads a bigger batch better over the cores.
        both = tok.ids([row["prompt"] for row in rows] + [row["completion"] for row in rows])
        prompts, completions = both[: len(rows)], both[len(rows):]
        out = []
        for prompt, completion in zip(prompts, completions, strict=True):
            ids = [tok.bos_id, *prompt, *completion, tok.eos_id]
            labels = [IGNORE] * (1 + len(prompt)) + [*completion, tok.eos_id]
            out.append((ids[:max_len], labels[:max_len], len(ids)))
        return out
    if fmt == "chat":
        return [_chat(row["messages"], tok, max_len) for row in rows]
    if fmt == "preference":  # two sequences per row, chosen then rejected, sharing the prompt
        out = []
        for pair in zip(*[encode_rows([{"prompt": row["prompt"], "completion": row[side]} for row in rows],
                                      "prompt_completion", tok, max_len) for side in ("chosen", "rejected")],
                        strict=True):
            out.extend(pair)
        return out
    raise ValueError(f"unknown format {fmt}")


def sequences_per_row(fmt: str) -> int:
    return 2 if fmt == "preference" else 1


def _chat(messages: list[dict], tok: LengthCounter, max_len: int) -> tuple[list[int], list[int], int]:
    from toolkit.data.chat_template import row_budget

    with row_budget():  # every prefix's render of one conversation shares one time budget
        return _chat_turns(messages, tok, max_len)


def _chat_turns(messages: list[dict], tok: LengthCounter, max_len: int) -> tuple[list[int], list[int], int]:
    ids: list[int] = []
    labels: list[int] = []
    for turn in range(len(messages)):
        # The template renders a prefix of the conversation; the new tokens belong to this turn.
        prefix = tok.ids([tok.render_chat(messages[: turn + 1])])[0]
        new = prefix[len(ids):]
        ids = prefix
        labels += new if messages[turn]["role"] == "assistant" else [IGNORE] * len(new)
        if len(ids) >= max_len and turn + 1 < len(messages):
            # The rest is cut at max_len anyway: one render of the whole conversation for its length,
            # not one per turn (a 2,000-turn row cost 2,000 renders of a growing prefix: quadratic).
            return ids[:max_len], labels[:max_len], len(tok.ids([tok.render_chat(messages)])[0])
    return ids[:max_len], labels[:max_len], len(ids)
