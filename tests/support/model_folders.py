"""Model folders for tests, written by hand: whole ones, and ones broken in each way a copy breaks."""

from __future__ import annotations

import json
import struct
from pathlib import Path


def write_safetensors(path: Path, tensors: dict[str, int]) -> None:
    """A valid safetensors file of float32 vectors (name -> length), without torch."""
    header, offset = {}, 0
    for name, length in tensors.items():
        header[name] = {"dtype": "F32", "shape": [length], "data_offsets": [offset, offset + 4 * length]}
        offset += 4 * length
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def write_model_folder(folder: Path, shards: int = 1) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {}, "merges": []}}))
    if shards == 1:
        write_safetensors(folder / "model.safetensors", {"a": 4, "b": 8})
        return folder
    weight_map = {}
    for index in range(shards):
        name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        write_safetensors(folder / name, {f"w{index}": 16})
        weight_map[f"w{index}"] = name
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder
