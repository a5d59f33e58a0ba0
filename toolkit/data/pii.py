"""Personal data and secrets in training text: warnings, never errors (users decide)."""

from __future__ import annotations

import re

PATTERNS = {
    "email": re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}"),
    "phone": re.compile(r"(?<!\w)(?:\+\d{1,3}[ .-]?)?(?:\(\d{2,4}\)[ .-]?|\d{2,4}[ .-])\d{3,4}[ .-]\d{3,4}(?!\w)"),
    "card_number": re.compile(r"(?<!\d)(?:\d[ -]?){13,19}(?!\d)"),
    "cloud_key": re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b|\bghp_[A-Za-z0-9]{36}\b|\bhf_[A-Za-z0-9]{30,}\b"
                            r"|-----BEGIN (?:RSA |EC |OPENSSH )?PRIVATE KEY-----"),
}


def luhn_valid(digits: str) -> bool:
    total, parity = 0, len(digits) % 2
    for index, char in enumerate(digits):
        value = int(char)
        if index % 2 == parity:
            value = value * 2 - 9 if value * 2 > 9 else value * 2
        total += value
    return total % 10 == 0


def part_of_longer_number(text: str, start: int, end: int) -> bool:
    """A phone-shaped run inside a longer group of digits (a card or order number) is not a phone."""
    after, before = text[end:end + 2], text[max(0, start - 2):start]
    return bool(re.match(r"[ .-]?\d", after)) or bool(re.search(r"\d[ .-]?$", before))


# Cheap tests that must pass before a pattern is worth running (most rows hold none of these).
_DIGIT = re.compile(r"\d")
_THIRTEEN_DIGITS = re.compile(r"(?:\d\D{0,2}){13}")
PREFILTERS = {
    "email": lambda text: "@" in text,
    "phone": lambda text: _DIGIT.search(text) is not None,
    "card_number": lambda text: _THIRTEEN_DIGITS.search(text) is not None,
    "cloud_key": lambda text: "AKIA" in text or "ASIA" in text or "ghp_" in text or "hf_" in text
    or "PRIVATE KEY" in text,
}


def find(text: str) -> list[str]:
    """Kinds of personal data or secrets present in `text`."""
    kinds = []
    for kind, pattern in PATTERNS.items():
        if not PREFILTERS[kind](text):
            continue
        for match in pattern.finditer(text):
            if kind == "phone" and part_of_longer_number(text, match.start(), match.end()):
                continue
            if kind == "card_number":
                digits = re.sub(r"\D", "", match.group())
                if not luhn_valid(digits):
                    continue
            kinds.append(kind)
            break
    return kinds
