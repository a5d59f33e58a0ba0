"""What the registry records about a version (version.json): given by the run that made the adapter
(AdapterRecord), completed by the registry (VersionRecord). A version.json is read back from a folder
another user made: it is parsed strictly, bounded, and believed only as far as the filesystem agrees
(toolkit/registry/store.py)."""

from __future__ import annotations

import json
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from toolkit.base.build import VERSION
from toolkit.base.names import NAME_PATTERN, RUN_ID_PATTERN
from toolkit.recipe.schema import REVISION_PATTERN

SHA256 = r"^[0-9a-f]{64}$"
MAX_EVAL_BYTES = 256 << 10
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class FileDigest(Frozen):
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=SHA256)


class LoraShape(Frozen):
    """What a server needs to know before it loads the adapter (vLLM's --max-lora-rank, its modules)."""
    peft_type: Literal["LORA"] = "LORA"
    rank: int = Field(ge=1)
    alpha: float = Field(gt=0)
    target_modules: list[str] | str


class AdapterRecord(Frozen):
    """What the run knows about its adapter. `eval` is the evaluation's own result, kept as written; the
    registry reads only its `passed` and `gates` ([{name, passed, detail}]) to decide promotions."""
    name: str = Field(pattern=NAME_PATTERN, description="The adapter's name (the recipe's name by default)")
    base_model: str = Field(min_length=1, max_length=1000)
    base_revision: str | None = Field(None, pattern=f"^{REVISION_PATTERN}$")
    account: str | None = Field(None, pattern=NAME_PATTERN)
    run_id: str | None = Field(None, pattern=RUN_ID_PATTERN.pattern)
    data_digests: dict[str, str] = Field(default_factory=dict, description="data file name -> its sha256")
    eval: dict = Field(default_factory=dict)
    ft_version: str = Field(VERSION, max_length=100)

    @field_validator("base_model")
    @classmethod
    def one_line(cls, value: str) -> str:
        if _CONTROL.search(value):
            raise ValueError("a base model is named on one line, without control characters")
        return value

    @field_validator("data_digests")
    @classmethod
    def digests(cls, value: dict[str, str]) -> dict[str, str]:
        for name, digest in value.items():
            if not 0 < len(name) <= 1000 or _CONTROL.search(name) or not re.fullmatch(SHA256, digest):
                raise ValueError(f"{name[:100]!r}: data digests map a file's name to its sha256 (64 hex digits)")
        return value

    @field_validator("eval")
    @classmethod
    def bounded(cls, value: dict) -> dict:
        try:
            size = len(json.dumps(value))
        except (TypeError, ValueError, RecursionError) as exc:
            raise ValueError(f"the evaluation's result is not plain JSON ({exc})") from None
        if size > MAX_EVAL_BYTES:
            raise ValueError(f"the evaluation's result is over {MAX_EVAL_BYTES >> 10} KiB")
        return value


class VersionRecord(AdapterRecord):
    """version.json: the record, and what the registry added when the version was made."""
    format: Literal[1] = 1
    id: str = Field(pattern=SHA256)
    creator: str = Field(max_length=100)
    creator_uid: int = Field(ge=0)
    created: float = Field(ge=0, le=1e11, allow_inf_nan=False)  # a Unix time (anything else: not ft's)
    files: dict[str, FileDigest]
    lora: LoraShape


def promotion_problem(record: AdapterRecord) -> str | None:
    """Why a version may never be promoted, or None: only an adapter whose evaluation passed, every
    gate included, is ever served."""
    result = record.eval
    gates = result.get("gates") if isinstance(result.get("gates"), list) else []
    failed = [gate for gate in gates if not (isinstance(gate, dict) and gate.get("passed") is True)]
    if failed:
        said = "; ".join(f"{gate.get('name', '?')}: {gate.get('detail', 'failed')}" if isinstance(gate, dict)
                         else f"{gate!r}: not a gate" for gate in failed[:5])
        return f"it failed {len(failed)} gate(s) ({said})"
    if "passed" not in result:
        return "it has no evaluation result (eval.passed): only an evaluated adapter is promoted"
    if result["passed"] is not True:
        return "its evaluation did not pass"
    return None
