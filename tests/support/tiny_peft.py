"""A tiny random Llama with LoRA adapters (built here, no hub), and the part of a DeepSpeed engine
the objectives and the evaluation use: what their unit tests run on."""

from __future__ import annotations

from pathlib import Path


def lora_model(folder: Path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from toolkit.train.tiny import build_model

    build_model(folder, vocab_size=64, hidden=32, layers=1)
    base = AutoModelForCausalLM.from_pretrained(folder)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                           task_type="CAUSAL_LM"))


class Engine:
    """What ft's objectives and evaluation use of a DeepSpeed engine: calling it, its module, its
    ZeRO stage."""

    def __init__(self, module):
        self.module = module

    def __call__(self, **batch):
        return self.module(**batch)

    def zero_optimization_stage(self) -> int:
        return 0
