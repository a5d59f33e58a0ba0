"""Is a model folder whole? A structural check, cheap and torch-free, used before any cache entry
(ft's tiny model, a model in the cluster's cache) is trusted on either side of the allocation.

Whole means: config.json names a model_type; every weight file it needs is there, inside the
folder, and each safetensors file's header parses and describes tensors that fit inside the file
(a truncated copy fails); the tokenizer is there and parses. Loading the weights is left to the
caller: this check reads headers only. It never raises on a broken folder: it names the problems.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

SAFETENSORS_INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header
MAX_JSON_BYTES = 64 << 20  # config, index and tokenizer files are far smaller


def read_json(file: Path) -> tuple[object, str | None]:
    """A JSON file's content, or why it cannot be had. Only regular files are opened (a FIFO
    would block)."""
    if not file.is_file():
        return None, f"{file.name} is missing" if not file.exists() else f"{file.name} is not a regular file"
    try:
        if file.stat().st_size > MAX_JSON_BYTES:
            return None, f"{file.name} is larger than {MAX_JSON_BYTES >> 20} MiB"
        return json.loads(file.read_bytes()), None
    except (OSError, ValueError, RecursionError) as exc:
        return None, f"{file.name} is unreadable: {str(exc)[:200]}"


def tensor_extent(entry: object) -> int | None:
    """Where a tensor's data ends, or None when its entry is malformed."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(v) is int for v in offsets)):
        return None
    begin, end = offsets
    return end if 0 <= begin <= end else None


def safetensors_problem(file: Path) -> str | None:
    """Why a .safetensors file is not whole, or None."""
    if not file.is_file():
        return f"{file.name} is not a regular file"
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            raw = handle.read(8)
            if len(raw) < 8:
                return f"{file.name} is truncated ({size} bytes)"
            (header_length,) = struct.unpack("<Q", raw)
            if header_length > min(MAX_HEADER_BYTES, size - 8):
                return f"{file.name} is truncated or not safetensors (header of {header_length} bytes)"
            header = json.loads(handle.read(header_length))
    except (OSError, ValueError, RecursionError) as exc:
        return f"{file.name} is unreadable: {str(exc)[:200]}"
    if not isinstance(header, dict):
        return f"{file.name} has a malformed header"
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
    if not tensors:
        return f"{file.name} holds no tensors"
    ends = [tensor_extent(entry) for entry in tensors.values()]
    if None in ends:
        return f"{file.name} has a malformed header (a tensor without valid data_offsets)"
    if 8 + header_length + max(ends) > size:
        return f"{file.name} is truncated ({size} bytes, its header describes {8 + header_length + max(ends)})"
    return None


def weight_files(folder: Path) -> tuple[list[Path], list[str]]:
    """The safetensors files a folder's weights live in, and the problems found listing them."""
    index = folder / SAFETENSORS_INDEX
    if index.exists():
        content, problem = read_json(index)
        if problem:
            return [], [problem]
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            return [], [f"{SAFETENSORS_INDEX} maps no weights"]
        shards = set(weight_map.values())
        # A shard is a file name inside the folder: never a path that leads elsewhere.
        if not all(isinstance(shard, str) and shard and "/" not in shard and shard not in (".", "..")
                   for shard in shards):
            return [], [f"{SAFETENSORS_INDEX} names a weight file outside the folder"]
        missing = sorted(shard for shard in shards if not (folder / shard).exists())
        present = [folder / shard for shard in sorted(shards) if (folder / shard).exists()]
        return present, [f"weight shard {shard} is missing" for shard in missing]
    single = folder / "model.safetensors"
    if single.exists():
        return [single], []
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        return [], ["its weights are pickle files (*.bin): convert them to safetensors, which load without "
                    "running code"]
    return [], ["it has no weights (model.safetensors or model.safetensors.index.json)"]


def tokenizer_problem(folder: Path) -> str | None:
    if (folder / "tokenizer.json").exists():
        content, problem = read_json(folder / "tokenizer.json")
        if problem:
            return problem
        return None if isinstance(content, dict) and content.get("model") else "tokenizer.json holds no tokenizer"
    if (folder / "tokenizer.model").is_file() and (folder / "tokenizer.model").stat().st_size > 0:
        return None
    return "the tokenizer is missing (tokenizer.json or tokenizer.model)"


def model_folder_problems(folder: Path) -> list[str]:
    """Everything that keeps a model folder from being whole; empty when it is whole."""
    if not folder.is_dir():
        return [f"{folder} is not a folder"]
    problems = []
    config, problem = read_json(folder / "config.json")
    if problem:
        problems.append(problem)
    elif not isinstance(config, dict) or not config.get("model_type"):
        problems.append("config.json names no model_type")
    files, listing_problems = weight_files(folder)
    problems += listing_problems
    problems += [problem for file in files if (problem := safetensors_problem(file))]
    if problem := tokenizer_problem(folder):
        problems.append(problem)
    return problems
