"""Where a base model comes from: a local path, the cluster's model cache (node-local disk, the
shared filesystem, the site's object store: toolkit/models/cache.py), or the hub; or 'tiny-llama',
built locally in the user's own cache. And the model loaded as the recipe's method trains it."""

from __future__ import annotations

import os
from pathlib import Path

from toolkit.base.cache_entries import discard, exclusive, staging_path
from toolkit.base.shared_dirs import trusted_owner_dir
from toolkit.models.cache import ModelFolderBroken, entry_name, find_model, shared_models
from toolkit.models.folder import model_folder_problems
from toolkit.recipe.schema import MethodSpec, TrainingSpec
from toolkit.train.tiny import ensure_tiny_llama


class ModelNotFound(RuntimeError):
    pass


def resolve_model(base: str, revision: str | None, shared_root: str, user_cache: Path, models_url: str = "",
                  log=lambda message: print(message, flush=True)) -> Path:
    """The folder to load a base model from: a local path as is, 'tiny-llama' built in the user's
    cache, else the nearest cache tier that has it whole (toolkit/models/cache.py), else the hub."""
    if base == "tiny-llama":
        return ensure_tiny_llama(user_cache / "models")
    if Path(base).is_dir():
        return Path(base)
    name = entry_name(base, revision)
    found, tried = find_model(name, shared_root, models_url, log)
    if found is not None:
        return found
    if os.environ.get("FT_ALLOW_HUB") != "1":
        raise ModelNotFound(
            f"model {base}{'@' + revision if revision else ''} is not in the cluster's model cache "
            f"(looked in {', '.join(tried)}), and this cluster does not download from the hub "
            "(FT_ALLOW_HUB is not 1). Put the model in the shared cache first.")
    from huggingface_hub import snapshot_download

    # One download per cluster (the other ranks wait and reuse it), into a staging folder renamed
    # into place once whole: a download cut short never becomes an entry.
    # (The shared tier by name: cache_dirs leaves out a tier it does not trust, so no index into it.)
    target = shared_models(shared_root) / name
    if not trusted_owner_dir(target.parent):
        raise ModelNotFound(f"the shared model cache {target.parent} belongs to another user: ft neither reads nor "
                            f"downloads into it. Ask the cluster's admins to own it (and to put {base} there)")
    if target.parent.exists() and not os.access(target.parent, os.W_OK | os.X_OK):
        raise ModelNotFound(f"{base} is not in the cluster's model cache, and you may not download into "
                            f"{target.parent}: ask the cluster's admins to put it there")
    with exclusive(target.with_name(f".{name}.lock")):
        if not model_folder_problems(target):
            return target
        discard(target)
        staging = staging_path(target, "download")
        snapshot_download(base, revision=revision, local_dir=staging)
        problems = model_folder_problems(staging)
        if problems:
            discard(staging)
            raise ModelFolderBroken(f"the download of {base} is not whole: {'; '.join(problems)}")
        staging.rename(target)
    return target


# transformers reads the DeepSpeed configuration through a weak reference: this keeps it alive for
# the rank's life (generation under ZeRO-3 and the engine's own checks ask it again later).
_ZERO3_CONFIG = None


def load_base_model(model_path: Path, method: str, precision: str, device=None, zero3: dict | None = None):
    """The base model in the training precision: 4-bit NF4 with double quantization for QLoRA
    (bitsandbytes, computing in that precision), else plain weights. DeepSpeed casts the module to
    bf16/fp16 anyway, so loading it so changes no value and halves the host memory and the load time
    (an 8B rank loading fp32 peaked at 45.7 GiB: benchmarks/GPU.md). Given a device (the rank's GPU,
    ZeRO-0/1/2), the weights go from the safetensors files straight to it: no whole copy in the
    rank's host memory. Given `zero3` (the rank's DeepSpeed configuration, ZeRO stage 3), each
    parameter is partitioned across the ranks as it is made (DeepSpeed's zero.Init, through
    transformers' HfDeepSpeedConfig) and filled from the files a layer at a time: no rank ever holds
    the whole model (eight ranks of a node held eight copies before). HF's KV cache is for
    generation: off in training (under torch.compile it forced a recompilation per layer)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    placement = {"device_map": {"": device}} if device is not None and zero3 is None else {}
    if method != "qlora":
        if zero3 is not None:
            from transformers.integrations import HfDeepSpeedConfig

            global _ZERO3_CONFIG
            _ZERO3_CONFIG = HfDeepSpeedConfig(zero3)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, **placement)
        model.config.use_cache = False
        return model
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(model_path, quantization_config=quantization, dtype=dtype,
                                                 **placement)
    model.config.use_cache = False
    quantized = sum(type(module).__name__ == "Linear4bit" for module in model.modules())
    print(f"QLoRA: {quantized} linear layers in 4-bit NF4", flush=True)
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def trainable_model(model_path: Path, method: MethodSpec, training: TrainingSpec, device=None, compile_layers=False,
                    zero3: dict | None = None):
    """The model as the recipe trains it: the base model (partitioned as it loads under ZeRO-3:
    `zero3`, the rank's DeepSpeed configuration), with LoRA adapters for lora and qlora; its decoder
    layers compiled (regional torch.compile) when asked."""
    model = load_base_model(model_path, method.kind, training.precision, device, zero3)
    if training.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if method.kind != "full":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=method.rank, lora_alpha=method.alpha, lora_dropout=method.dropout,
                                                 target_modules=method.target_modules, task_type="CAUSAL_LM"))
    if compile_layers:
        compile_decoder_layers(model)
    return model


def compile_decoder_layers(model) -> int:
    """Regional compilation: each decoder layer compiled in place (nn.Module.compile: the module and
    its state_dict keys stay as they are, so checkpoints and exports do not change). The layers share
    their code, so one graph serves them all (two: the first layer's input needs no gradient); a
    whole-model compile would take minutes and break at transformers' mask and cache logic."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        print(f"warning: {type(base).__name__} has no decoder layers to compile: it runs eagerly", flush=True)
        return 0
    for layer in layers:
        layer.compile()
    return len(layers)

