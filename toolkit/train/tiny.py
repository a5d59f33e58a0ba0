"""A tiny Llama and its tokenizer, built locally (no hub): the base model of the lab's recipes and
of the tests. Deterministic: the same seed builds the same weights and vocabulary."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Question: what is the capital of France? Answer: Paris.",
    "Translate to French: cat -> chat, dog -> chien, house -> maison, water -> eau.",
    "User: hello there! Assistant: hello, how can I help you today?",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 + - = * / ( ) [ ] { } : ; , . ! ?",
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
]


# A simple role-tagged chat template, so chat data trains with loss on the assistant turns only.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message['role'] }}: {{ message['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def train_tiny_tokenizer(vocab_size: int = 512):
    """The tiny byte-level BPE (tokenizers only: the login node can build it without torch)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(TINY_CORPUS * 20, trainer=trainer)
    return tokenizer


def build_tokenizer(path: Path, vocab_size: int = 512):
    from transformers import PreTrainedTokenizerFast

    wrapped = PreTrainedTokenizerFast(tokenizer_object=train_tiny_tokenizer(vocab_size), bos_token="<s>",
                                      eos_token="</s>", pad_token="<pad>")
    wrapped.chat_template = TINY_CHAT_TEMPLATE
    wrapped.save_pretrained(path)
    return wrapped


def build_model(path: Path, vocab_size: int, seed: int = 0, hidden: int = 256, layers: int = 2) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden * 2,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=1024, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                         tie_word_embeddings=False)
    # is_main_process: under torch.distributed, transformers would otherwise write only on rank 0.
    LlamaForCausalLM(config).save_pretrained(path, is_main_process=True)


def ensure_tiny_llama(cache_dir: Path, hidden: int = 256, layers: int = 2) -> Path:
    """Build the tiny model once per cache (ranks on every node may ask at the same time)."""
    path = cache_dir / f"tiny-llama-h{hidden}-l{layers}"
    if (path / ".complete").exists():
        return path
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".tiny-llama.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / ".complete").exists():
            staging = cache_dir / f".building-{os.getpid()}"
            tokenizer = build_tokenizer(staging)
            build_model(staging, len(tokenizer), hidden=hidden, layers=layers)
            (staging / ".complete").write_text("ok\n")
            staging.rename(path)
    return path
