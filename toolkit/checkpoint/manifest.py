"""What makes a checkpoint whole, in every tier: a manifest, written last, naming each file with its
size and sha256, the step, and the lineage (which model and method the state belongs to). A copy is
used only when its every file matches; a manifest from elsewhere (an object store) is checked before
any of its names becomes a local path."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from toolkit.base.digests import sha256_file

MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 4 << 20
TAG_PATTERN = re.compile(r"step-(\d{8,12})")
# A file name inside a checkpoint: relative, plain parts, never '..' (it becomes a local path).
_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]{0,200}")


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def step_of(tag: str) -> int:
    return int(tag.removeprefix("step-"))


def is_tag(name: str) -> bool:
    return TAG_PATTERN.fullmatch(name) is not None


def lineage_of(recipe) -> str:
    """What a checkpoint's state is of: the base model and the method. A checkpoint of another
    lineage (a recipe that changed its model or LoRA shape but kept its mirror) is never loaded."""
    basis = {"model": recipe.model.model_dump(mode="json"), "method": recipe.method.model_dump(mode="json"),
             "objective": recipe.objective.kind}
    return hashlib.sha256(json.dumps(basis, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class FileEntry:
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    step: int
    files: dict[str, FileEntry]
    lineage: str = ""  # empty in checkpoints written before lineages were recorded
    seal: str = ""  # the owner's HMAC over the rest (toolkit/checkpoint/seal.py); empty: not sealed

    @property
    def tag(self) -> str:
        return tag_for(self.step)

    @property
    def total_bytes(self) -> int:
        return sum(entry.bytes for entry in self.files.values())

    def _fields(self) -> dict:
        files = {name: {"bytes": e.bytes, "sha256": e.sha256} for name, e in sorted(self.files.items())}
        return {"step": self.step, "lineage": self.lineage, "files": files}

    def signed_bytes(self) -> bytes:
        """What a seal covers: every field but the seal, in one canonical form."""
        return json.dumps(self._fields(), sort_keys=True, separators=(",", ":")).encode()

    def to_json(self) -> str:
        return json.dumps(self._fields() | ({"seal": self.seal} if self.seal else {}), indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """ValueError, saying what, for anything but a well-formed manifest with safe file names."""
        if len(text) > MAX_MANIFEST_BYTES:
            raise ValueError(f"the manifest is over {MAX_MANIFEST_BYTES} bytes")
        try:
            raw = json.loads(text)
        except RecursionError:
            raise ValueError("the manifest is nested too deeply") from None
        if not isinstance(raw, dict) or not isinstance(raw.get("files"), dict) or type(raw.get("step")) is not int:
            raise ValueError("the manifest lacks its step or its files")
        if raw["step"] < 0 or not raw["files"]:
            raise ValueError("the manifest has a negative step or names no file")
        files = {}
        for name, entry in raw["files"].items():
            if not safe_name(name):
                raise ValueError(f"the manifest names an unsafe path {name!r}")
            if not (isinstance(entry, dict) and type(entry.get("bytes")) is int and entry["bytes"] >= 0
                    and isinstance(entry.get("sha256"), str) and re.fullmatch(r"[0-9a-f]{64}", entry["sha256"])):
                raise ValueError(f"the manifest's entry for {name} is malformed")
            files[name] = FileEntry(entry["bytes"], entry["sha256"])
        lineage = raw.get("lineage", "")
        if not isinstance(lineage, str):
            raise ValueError("the manifest's lineage is not a string")
        seal = raw.get("seal", "")
        if not isinstance(seal, str) or (seal and not re.fullmatch(r"[0-9a-f]{64}", seal)):
            raise ValueError("the manifest's seal is not a sha256 HMAC in lowercase hex")
        return cls(raw["step"], files, lineage, seal)


def safe_name(name: str) -> bool:
    return isinstance(name, str) and all(_PART.fullmatch(part) for part in name.split("/"))


def describe(folder: Path, step: int, lineage: str) -> Manifest:
    """The manifest of a fully written folder (dot files, the ranks' marks, are not part of it)."""
    files = {}
    for path in sorted(folder.rglob("*")):
        name = str(path.relative_to(folder))
        if path.is_file() and name != MANIFEST and not any(part.startswith(".") for part in Path(name).parts):
            files[name] = FileEntry(path.stat().st_size, sha256_file(path))
    return Manifest(step, files, lineage)


def read(folder: Path) -> Manifest:
    with open(folder / MANIFEST, "rb") as handle:
        return Manifest.from_json(handle.read(MAX_MANIFEST_BYTES + 1))


def problem(folder: Path, manifest: Manifest) -> str | None:
    """None when every file the manifest names is in `folder`, whole and unchanged; else what is wrong."""
    for name, expected in manifest.files.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected.bytes:
            return f"{name} is {size} bytes, the manifest says {expected.bytes}"
        if sha256_file(path) != expected.sha256:
            return f"{name} does not match its sha256"
    return None


def lineage_problem(manifest: Manifest, lineage: str | None) -> str | None:
    if lineage and manifest.lineage and manifest.lineage != lineage:
        return (f"it was made for another model or method (lineage {manifest.lineage}, this run's is {lineage}): "
                "a recipe that changes its model or method needs its own checkpoint folder and mirror")
    return None


def verify(folder: Path, lineage: str | None = None, step: int | None = None) -> str | None:
    """None when the checkpoint in `folder` is whole, unchanged, of this lineage (and of this step);
    else what is wrong."""
    try:
        manifest = read(folder)
    except (OSError, ValueError):
        return "no readable manifest (the write never finished)"
    if step is not None and manifest.step != step:
        return f"its manifest is of step {manifest.step}"
    return lineage_problem(manifest, lineage) or problem(folder, manifest)
