"""LoRA adapter folders for the registry's tests, written by hand (no torch, no peft), and the records
a run's evaluation would give them."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.model_folders import write_safetensors
from toolkit.registry.records import AdapterRecord

DIGEST = "ab" * 32


def write_adapter(folder: Path, seed: int = 0, rank: int = 8) -> Path:
    """What peft's save_pretrained and a tokenizer leave: a config, safetensors weights, tokenizer files.
    Another seed, other weights: another version."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": "tiny-llama"}))
    write_safetensors(folder / "adapter_model.safetensors", {f"lora_A.{seed}": 4 + seed, "lora_B": 8})
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {}, "merges": []}}))
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


def evaluation(passed: bool = True) -> dict:
    gate = {"name": "beats_base", "passed": passed,
            "detail": "eval loss 1.10 < base 1.60" if passed else "eval loss 1.70 >= base 1.60"}
    return {"passed": passed, "gates": [gate], "eval_loss": 1.1 if passed else 1.7, "base_loss": 1.6}


def record(name: str = "tiny-lora-sft", passed: bool = True, **fields) -> AdapterRecord:
    return AdapterRecord(**{"name": name, "base_model": "meta-llama/Llama-3.1-8B", "base_revision": "main",
                            "account": "research", "run_id": f"{name}-20250101-abcdefgh",
                            "data_digests": {"train.jsonl": DIGEST}, "eval": evaluation(passed), **fields})
