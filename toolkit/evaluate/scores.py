"""Judge-free task metrics of a completion against its reference: exact match (after normalising
whitespace and case) and SQuAD's token F1 (partial credit for the words both share)."""

from __future__ import annotations

from collections import Counter


def normalised(text: str) -> str:
    return " ".join(text.lower().split())


def exact_match(completion: str, reference: str) -> float:
    return float(normalised(completion) == normalised(reference))


def token_f1(completion: str, reference: str) -> float:
    said, wanted = normalised(completion).split(), normalised(reference).split()
    if not said or not wanted:
        return float(said == wanted)
    shared = sum((Counter(said) & Counter(wanted)).values())
    if shared == 0:
        return 0.0
    precision, recall = shared / len(said), shared / len(wanted)
    return 2 * precision * recall / (precision + recall)


SCORES = {"exact_match": exact_match, "token_f1": token_f1}
