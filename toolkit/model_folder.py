"""Is a model folder whole? A structural check, cheap and torch-free, used before any cache entry
(ft's tiny model, a model in the cluster's cache) is trusted on either side of the allocation.

Whole means: config.json names a model_type; every weight file it needs is there, and each
safetensors file's header parses and its tensors fit inside the file (a truncated copy fails);
the tokenizer is there. Loading the weights is left to the caller: this check reads headers only.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

SAFETENSORS_INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header


def safetensors_problem(file: Path) -> str | None:
    """Why a .safetensors file is not whole, or None."""
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
    except (OSError, ValueError) as exc:
        return f"{file.name} is unreadable: {exc}"
    ends = [entry["data_offsets"][1] for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry]
    if not ends:
        return f"{file.name} holds no tensors"
    if 8 + header_length + max(ends) > size:
        return f"{file.name} is truncated ({size} bytes, its header describes {8 + header_length + max(ends)})"
    return None


def weight_files(folder: Path) -> tuple[list[Path], list[str]]:
    """The safetensors files a folder's weights live in, and the problems found listing them."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return [], [f"{SAFETENSORS_INDEX} is unreadable: {exc}"]
        missing = [shard for shard in shards if not (folder / shard).is_file()]
        return [folder / shard for shard in shards], [f"weight shard {shard} is missing" for shard in missing]
    single = folder / "model.safetensors"
    if single.is_file():
        return [single], []
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        return [], ["its weights are pickle files (*.bin): convert them to safetensors, which load without "
                     "running code"]
    return [], ["it has no weights (model.safetensors or model.safetensors.index.json)"]


def model_folder_problems(folder: Path, tokenizer: bool = True) -> list[str]:
    """Everything that keeps a model folder from being whole; empty when it is whole."""
    if not folder.is_dir():
        return [f"{folder} is not a folder"]
    problems = []
    try:
        config = json.loads((folder / "config.json").read_text())
        if not isinstance(config, dict) or not config.get("model_type"):
            problems.append("config.json names no model_type")
    except FileNotFoundError:
        problems.append("config.json is missing")
    except (OSError, ValueError) as exc:
        problems.append(f"config.json is unreadable: {exc}")
    files, listing_problems = weight_files(folder)
    problems += listing_problems
    problems += [problem for file in files if file.is_file() and (problem := safetensors_problem(file))]
    if tokenizer and not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer.model").is_file():
        problems.append("the tokenizer is missing (tokenizer.json or tokenizer.model)")
    return problems
