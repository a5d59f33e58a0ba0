"""What Slurm's JSON looks like on each version, read into one shape.

`squeue --json` and `sacct --json` changed with every data_parser version (Slurm's REST and CLI share
it: v0.0.38 in 22.05, v0.0.39 in 23.02, v0.0.40 in 23.11, v0.0.41 in 24.05, v0.0.42 in 24.11,
v0.0.44 in 25.11 and on). What ft reads of them, and how it differs:

  job state     22.05: "RUNNING"; 23.02 on: ["RUNNING"] or ["PENDING", "REQUEUED"] (the state, then
                its flags); sacct: {"current": ..., "reason": ...}, "current" itself a word or a list
  numbers       22.05: 1700000000; 23.02 on: {"set": true, "infinite": false, "number": 1700000000}
                (unset: "set" false; a time limit of UNLIMITED: "infinite" true)
  user          squeue 22.05-25.x: "user_name"; sacct: "user"
  GPUs held     squeue: "tres_req_str"/"tres_alloc_str" text (gres/gpu=8); sacct: tres.allocated, a
                list of {"type": "gres", "name": "gpu", "count": 8}
  no value      22.05: null or 0; 24.11: Slurm's NO_VAL and INFINITE as numbers (a job that never
                started: "start": 4294967294)
  requeued      sacct's record of an allocation a requeue ended: 22.05 "REQUEUED"; 24.11
                ["PENDING", "REQUEUED"]
  no nodes      sacct: "None assigned"

Every reader here takes a value as any of these versions gives it and returns plain Python: a
caller never sees a version. Recorded answers of each version are unit-test fixtures
(tests/unit/recorded/slurm/, made by scripts/record-slurm-outputs.sh).
"""

from __future__ import annotations

import math
import re

# A squeue or sacct TRES text (`tres_req_str`, AllocTRES): how many GPUs a job asks for or holds.
TRES_GPUS = re.compile(r"(?:^|,)gres/gpu(?::[^=,]+)?=(\d+)(?:,|$)")


# Slurm's NO_VAL and INFINITE (32 and 64 bits), which some fields carry as plain numbers (the 16-bit
# ones are not markers in any field ft reads: 65534 is a job id like any other).
NO_VALUES = {0xFFFFFFFE, 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFE, 0xFFFFFFFFFFFFFFFF}


def number(value: object) -> int | float | None:
    """A number as any Slurm version writes it; None where unset or infinite (a limit of UNLIMITED)."""
    if isinstance(value, dict):
        if not value.get("set", True) or value.get("infinite"):
            return None
        value = value.get("number")
    if isinstance(value, bool) or not isinstance(value, int | float) or value in NO_VALUES:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


# 22.05 names a job by one word: the first of these flags it has, else its base state (Slurm's
# job_state_string). 23.02 on lists the base state and its flags: read the same way, a completing
# job is COMPLETING on every release (not yet finished), a configuring one CONFIGURING (not running).
FLAG_WORDS = ("COMPLETING", "CONFIGURING", "RESIZING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD",
              "SPECIAL_EXIT", "STOPPED", "REVOKED", "RESV_DEL_HOLD", "SIGNALING", "STAGE_OUT")


def state(value: object) -> str:
    """A job's state as one word, as 22.05 gives it on every release; "" when absent."""
    if isinstance(value, dict):  # sacct: {"current": ..., "reason": ...}
        value = value.get("current")
    if isinstance(value, list):
        words = [str(word).upper() for word in value]
        return next((flag for flag in FLAG_WORDS if flag in words[1:]), words[0] if words else "")
    words = str(value or "").split()
    return words[0].upper() if words else ""


def state_flags(value: object) -> tuple[str, ...]:
    """The flags beside a job's state (23.02 on: ["PENDING", "REQUEUED"]); () on 22.05."""
    if isinstance(value, dict):
        value = value.get("current")
    if isinstance(value, list):
        return tuple(str(flag).upper() for flag in value[1:])
    return ()


def dig(document: object, *keys: str) -> object:
    """A nested field (None where any level is missing), its number unwrapped where it is one."""
    value = document
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    if (isinstance(value, dict) and ("number" in value or "set" in value)) or \
            (isinstance(value, int | float) and not isinstance(value, bool)):
        return number(value)
    return value


def text(value: object) -> str:
    """A string field ("" where missing or not a string)."""
    return value if isinstance(value, str) else ""


def tres_gpus(tres: object) -> int:
    """The GPUs in a TRES text (gres/gpu=8, or gres/gpu:h100=8) or sacct's TRES list."""
    if isinstance(tres, list):
        # "gpu" and each typed "gpu:h100" are listed: the untyped one counts them all once
        return sum(int(number(item.get("count")) or 0) for item in tres
                   if isinstance(item, dict) and item.get("type") == "gres" and item.get("name") == "gpu")
    found = TRES_GPUS.search(text(tres))
    return int(found.group(1)) if found else 0


def version(answer: object) -> tuple[int, int, int] | None:
    """The Slurm version a JSON answer says it came from (meta.slurm.version, or meta.Slurm.version
    on 22.05); None where it names none."""
    meta = answer.get("meta") if isinstance(answer, dict) else None
    slurm = (meta.get("slurm") or meta.get("Slurm")) if isinstance(meta, dict) else None
    found = slurm.get("version") if isinstance(slurm, dict) else None
    if not isinstance(found, dict):
        return None
    parts = [found.get(key) for key in ("major", "minor", "micro")]
    try:
        return tuple(int(part) for part in parts)  # type: ignore[return-value]
    except (TypeError, ValueError):
        return None
