"""The tiny model's tokenizer: a byte-level BPE trained locally (no hub), deterministic. Here, on the
login side, because validation counts tokens with it; toolkit.train.tiny builds the model around it."""

from __future__ import annotations

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
