"""Token counts on the login node with the `tokenizers` library alone (no torch, no transformers)."""

from __future__ import annotations

import glob
import hashlib
import json
from pathlib import Path

from toolkit.data.chat_template import RENDERING as CHAT_RENDERING
from toolkit.data.chat_template import ChatTemplate
from toolkit.storage.object_store import ObjectStore

SPECIAL_OVERHEAD = 2  # BOS + EOS around every sequence


class TokenizerNotFound(ValueError):
    pass


def identity(tokenizer, chat_template: str | None, bos: str, eos: str) -> str:
    """What decides the tokens of a text: vocabulary, merges, pre-tokenization, special tokens and
    the chat template. Not the post-processor: ft adds BOS/EOS itself."""
    definition = json.loads(tokenizer.to_str())
    parts = {key: definition.get(key) for key in ("normalizer", "pre_tokenizer", "model", "added_tokens")}
    text = json.dumps([parts, chat_template, bos, eos, CHAT_RENDERING], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


class LengthCounter:
    """A tokenizer (the `tokenizers` library), its chat template and its BOS/EOS tokens: all that
    validation and the training workers need to turn rows into tokens, the same way on both."""

    def __init__(self, tokenizer, chat_template: str | None, bos: str = "<s>", eos: str = "</s>"):
        self.tokenizer = tokenizer
        self.identity = identity(tokenizer, chat_template, bos, eos)
        # A model folder's chat template is code from whoever wrote the folder: it renders in a
        # bounded sandbox (toolkit/data/chat_template.py), reading its inputs and nothing else.
        self._template = ChatTemplate(chat_template) if chat_template else None
        self.bos_id = tokenizer.token_to_id(bos)
        self.eos_id = tokenizer.token_to_id(eos)

    def ids(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast skips character offsets, which ft never uses.
        return [encoding.ids for encoding in self._encode(texts, add_special_tokens=False)]

    @property
    def _encode(self):
        return getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)

    def lengths(self, texts: list[str]) -> list[int]:
        encodings = self._encode(texts, add_special_tokens=False)
        return [len(encoding.ids) + SPECIAL_OVERHEAD for encoding in encodings]

    def render_chat(self, messages: list[dict]) -> str:
        if self._template is None:
            return "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        return self._template.render(messages)


def _from_dir(folder: Path) -> LengthCounter:
    from tokenizers import Tokenizer

    file = folder / "tokenizer.json"
    if not file.is_file():
        raise TokenizerNotFound(f"{folder} has no tokenizer.json")
    template = None
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    elif (folder / "tokenizer_config.json").is_file():
        template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    special = {"bos": "<s>", "eos": "</s>"}
    if (folder / "tokenizer_config.json").is_file():
        config = json.loads((folder / "tokenizer_config.json").read_text())
        for name in special:
            token = config.get(f"{name}_token")
            special[name] = token.get("content") if isinstance(token, dict) else token or special[name]
    text = file.read_text()
    return LengthCounter(Tokenizer.from_str(text), template, **special)


def load_length_counter(spec: str, shared_root: str = "", models_url: str = "",
                        cache: Path | None = None, store: ObjectStore | None = None) -> LengthCounter:
    """A tokenizer by model name ('tiny-llama', a local folder, a model id in the cluster's model
    cache, or in its object store: `models_url`, its tokenizer files fetched into `cache`) or by the
    path of a tokenizer.json. `store` reaches `models_url` (by default, the store the environment
    names)."""
    if spec == "tiny-llama":
        from toolkit.data.tiny_tokenizer import TINY_CHAT_TEMPLATE, train_tiny_tokenizer

        tokenizer = train_tiny_tokenizer()
        return LengthCounter(tokenizer, TINY_CHAT_TEMPLATE)
    path = Path(spec)
    if path.is_file():
        return _from_dir(path.parent)
    if path.is_dir():
        return _from_dir(path)
    from toolkit.models.cache import cache_dirs

    name = spec.replace("/", "--")
    for tier in cache_dirs(shared_root or "/nonexistent"):
        # The model's own entry, or one of its revisions (name@revision): never another model whose
        # name merely starts the same way.
        candidates = [tier / name, *sorted(tier.glob(f"{glob.escape(name)}@*"))] if tier.is_dir() else []
        for candidate in candidates:
            if (candidate / "tokenizer.json").is_file():
                return _from_dir(candidate)
    if models_url and cache is not None:
        from toolkit.models.cache import fetch_tokenizer

        fetched = fetch_tokenizer(name, models_url, cache, shared_root, store or ObjectStore())
        if fetched is not None:
            return _from_dir(fetched)
    raise TokenizerNotFound(f"no tokenizer for {spec!r}: not a folder or tokenizer.json, and not in the cluster's "
                            "model cache" + (f" or its object store ({models_url})" if models_url else ""))
