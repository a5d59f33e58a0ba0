"""What a LoRA serving fleet loads (vLLM's `--lora-modules name=path`, TGI's LORA_ADAPTERS, LoRAX's
adapter_id): serving.json beside each version, and names/<name>/promoted.json, the one file a fleet
polls to learn which version its name serves now.

serving.json names the adapter (name and version), the base model it must be loaded beside (name and
revision), the adapter's folder on the shared filesystem and in the object store, every file with its
bytes and sha256 (a loader checks what it fetched), and the LoRA's shape (rank, alpha, modules: vLLM's
--max-lora-rank must be at least the rank).
"""

from __future__ import annotations

from pathlib import Path

from toolkit.registry.records import VersionRecord
from toolkit.registry.states import Transition

FORMAT = "ft-lora-handoff/1"


def serving_manifest(record: VersionRecord, adapter: Path, s3_uri: str | None) -> dict:
    return {
        "format": FORMAT,
        "name": record.name,
        "version": record.id,
        "base_model": {"name": record.base_model, "revision": record.base_revision},
        "adapter": {"path": str(adapter), "s3_uri": s3_uri,
                    "files": {name: digest.model_dump() for name, digest in sorted(record.files.items())}},
        "lora": record.lora.model_dump(),
        "lora_modules": f"{record.name}={adapter}",  # vLLM's --lora-modules, TGI's LORA_ADAPTERS
    }


def promoted_pointer(name: str, serving: dict | None, promotion: Transition | None) -> dict:
    """The name's promoted version and its handoff; version null while none is."""
    if serving is None or promotion is None:
        return {"format": FORMAT, "name": name, "version": None}
    return {"format": FORMAT, "name": name, "version": serving["version"], "promoted": promotion.to_dict(),
            "serving": serving}
