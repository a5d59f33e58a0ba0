"""A tiny Llama and its tokenizer, built locally (no hub): the base model of the lab's recipes and
of the tests. Deterministic: the same seed builds the same weights and vocabulary."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from toolkit.base.cache_entries import discard, exclusive, staging_path
from toolkit.data.tiny_tokenizer import TINY_CHAT_TEMPLATE, train_tiny_tokenizer
from toolkit.models.folder import model_folder_problems

COMPLETE = ".complete"  # written last, after the folder was seen to load


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
    LlamaForCausalLM(config).save_pretrained(path)


def build_and_check(path: Path, hidden: int, layers: int) -> None:
    """Build into `path` and load it back: what is marked complete has been seen to load."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = build_tokenizer(path)
    build_model(path, len(tokenizer), hidden=hidden, layers=layers)
    problems = model_folder_problems(path)
    if problems:
        raise RuntimeError(f"the tiny model built in {path} is not whole: {'; '.join(problems)}")
    AutoModelForCausalLM.from_pretrained(path)
    AutoTokenizer.from_pretrained(path)


# Variables that make a process part of a distributed job. The builder runs without them: under an
# initialised torch.distributed group, transformers writes weights on global rank 0 only, so a
# build by any other rank would leave a folder without weights.
DISTRIBUTED_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR",
                         "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")


def build_in_subprocess(path: Path, hidden: int, layers: int) -> None:
    env = {name: value for name, value in os.environ.items() if name not in DISTRIBUTED_VARIABLES}
    result = subprocess.run([sys.executable, "-m", "toolkit.train.tiny", str(path), str(hidden), str(layers)],
                            env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"building the tiny model in {path} failed (exit {result.returncode}):\n"
                           f"{result.stderr[-4000:]}")


def is_whole(path: Path) -> bool:
    return (path / COMPLETE).is_file() and not model_folder_problems(path)


def ensure_tiny_llama(cache_dir: Path, hidden: int = 256, layers: int = 2,
                      warn: Callable[[str], None] = print) -> Path:
    """The tiny model in the cache, built once per cache. Any rank of any node may ask first and at
    the same time; an entry is trusted only when whole, and one that is not is rebuilt."""
    path = cache_dir / f"tiny-llama-h{hidden}-l{layers}"
    if is_whole(path):
        return path
    with exclusive(cache_dir / ".tiny-llama.lock"):
        if is_whole(path):
            return path
        if os.path.lexists(path):  # a dangling symlink too
            problems = model_folder_problems(path) or [f"{COMPLETE} is missing"]
            warn(f"warning: the cached tiny model {path} is not whole ({'; '.join(problems)}): rebuilding it")
            discard(path)
        for stale in cache_dir.glob(f".building-{path.name}-*"):  # only a builder holding this lock makes these
            discard(stale)
        staging = staging_path(path)
        build_in_subprocess(staging, hidden, layers)
        (staging / COMPLETE).write_text("ok\n")
        staging.rename(path)
    return path


if __name__ == "__main__":  # the builder: python -m toolkit.train.tiny FOLDER HIDDEN LAYERS
    build_and_check(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
