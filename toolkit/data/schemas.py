"""The three dataset shapes ft trains on, and the checks of one row against its shape."""

from __future__ import annotations

from typing import Any

FORMATS = ("prompt_completion", "chat", "preference")
ROLES = {"system", "user", "assistant", "tool"}


def detect_format(row: dict[str, Any]) -> str | None:
    if "messages" in row:
        return "chat"
    if "chosen" in row or "rejected" in row:
        return "preference"
    if "prompt" in row or "completion" in row:
        return "prompt_completion"
    return None


def _text(row: dict, field: str, problems: list) -> None:
    if field not in row or row[field] is None:
        problems.append(("missing_field", field, f"{field} is missing"))
    elif not isinstance(row[field], str):
        problems.append(("wrong_type", field, f"{field} must be a string, not {type(row[field]).__name__}"))
    elif not row[field].strip():
        problems.append(("empty_field", field, f"{field} is empty"))


def check_row(row: dict[str, Any], fmt: str) -> list[tuple[str, str, str]]:
    """Problems of one row as (kind, field, message); empty when the row is good."""
    problems: list[tuple[str, str, str]] = []
    if fmt == "prompt_completion":
        _text(row, "prompt", problems)
        _text(row, "completion", problems)
    elif fmt == "preference":
        for field in ("prompt", "chosen", "rejected"):
            _text(row, field, problems)
        if not problems and row["chosen"] == row["rejected"]:
            problems.append(("same_chosen_rejected", "chosen", "chosen and rejected are the same text"))
    else:
        _check_messages(row.get("messages"), problems)
    return problems


def _check_messages(messages: Any, problems: list) -> None:
    if messages is None:
        problems.append(("missing_field", "messages", "messages is missing"))
        return
    if not isinstance(messages, list) or not messages:
        problems.append(("wrong_type", "messages", "messages must be a non-empty list of {role, content}"))
        return
    previous = None
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            problems.append(("wrong_type", where, f"{where} must be an object with role and content"))
            return
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            problems.append(("bad_role", f"{where}.role", f"unknown role {role!r}; use one of {sorted(ROLES)}"))
            return
        if not isinstance(content, str):
            problems.append(("wrong_type", f"{where}.content", f"{where}.content must be a string"))
            return
        if not content.strip():
            problems.append(("empty_field", f"{where}.content", f"{where}.content is empty"))
        if role == "system" and index != 0:
            problems.append(("bad_order", f"{where}.role", "a system message may only come first"))
        if role == previous and role in {"user", "assistant"}:
            problems.append(("bad_order", f"{where}.role", f"two {role} turns in a row"))
        previous = role
    if messages[-1].get("role") != "assistant":
        problems.append(("bad_order", f"messages[{len(messages) - 1}].role",
                         "the conversation must end with an assistant turn (there is nothing to learn otherwise)"))
