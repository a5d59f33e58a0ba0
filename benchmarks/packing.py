"""Trained tokens per second with sequence packing (toolkit/train/packing.py) against padding each
micro batch to its longest example, on a long-tailed mix of lengths like real chat data (median an
eighth of max_seq_len). Target (issue 35): packed >= 2x padded, on this machine.

Both arms run ft's own pieces on the CPU: examples in a shuffled order, ft's collate, ft's loss
(losses.py), backward and AdamW on a small random Llama with LoRA adapters. Padded: micro batches of
--micro examples, padded to the longest. Packed: the same examples packed into rows of max_seq_len,
micro batches of as many rows. Counted: the tokens that are not padding. The arms alternate, --rounds
times, each for --steps steps after one warm-up step; the ratio is of the medians. For each micro batch
size the table also gives what removing the padding alone would gain there: packed fill / padded fill (a
padded micro batch of two wastes a third of its tokens, one of eight about two thirds); measured ratios
can pass it, since a padded batch's cost per token also varies with its length.

    python benchmarks/packing.py [--max-len 512] [--micro 2,4,8] [--steps 6] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.tiny_peft import Engine  # noqa: E402 - the stand-in for DeepSpeed's engine the unit tests use
from toolkit.train.data import IGNORE, Example, collate  # noqa: E402 - the checkout's own toolkit
from toolkit.train.packing import fill, pack  # noqa: E402


def long_tailed(count: int, max_len: int, seed: int) -> list[int]:
    """Log-normal lengths, median max_len/8, a long tail cut at max_len (what chat datasets look like:
    most turns short, a few near the limit)."""
    generator = random.Random(seed)
    median = max_len / 8
    return [max(8, min(max_len, round(generator.lognormvariate(0, 1.0) * median))) for _ in range(count)]


def examples_of(lengths: list[int], vocab: int, seed: int) -> list[Example]:
    generator = random.Random(seed)
    made = []
    for length in lengths:
        ids = [generator.randrange(3, vocab) for _ in range(length)]
        prompt = length // 4
        made.append(Example(ids, [IGNORE] * prompt + ids[prompt:]))
    return made


def model_for(args):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 128),
                         vocab_size=args.vocab, max_position_embeddings=args.max_len, use_cache=False,
                         tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                  "o_proj"], task_type="CAUSAL_LM"))


def run_arm(model, optimizer, batches: list[list[Example]], start: int, steps: int) -> tuple[float, int]:
    """(seconds, non-padding tokens) of `steps` steps from batch `start` (cycling)."""
    from toolkit.train.losses import causal_lm_loss

    tokens, began = 0, time.perf_counter()
    for step in range(start, start + steps):
        batch = collate(batches[step % len(batches)], pad_id=0)
        tokens += int(batch["attention_mask"].sum())
        causal_lm_loss(Engine(model), batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - began, tokens


def compare(model, optimizer, examples: list[Example], lengths: list[int], micro: int, args) -> dict:
    """Padded against packed at one micro batch size: the median rates over the rounds, and what
    removing the padding alone would gain (packed fill / padded fill)."""
    order = list(range(len(examples)))
    random.Random(3).shuffle(order)  # as ft's batch_indices: a shuffled epoch
    padded = [[examples[i] for i in order[k:k + micro]] for k in range(0, len(order), micro)]
    rows = pack(examples, args.max_len)
    random.Random(3).shuffle(rows)
    packed = [rows[k:k + micro] for k in range(0, len(rows), micro)]
    padded_fill = sum(lengths) / sum(len(b) * max(len(e.input_ids) for e in b) for b in padded)
    rates: dict[str, list[float]] = {"padded": [], "packed": []}
    for _, batches in (("padded", padded), ("packed", packed)):  # one warm-up step each
        run_arm(model, optimizer, batches, 0, 1)
    for round_index in range(args.rounds):
        for arm, batches in (("padded", padded), ("packed", packed)):
            seconds, tokens = run_arm(model, optimizer, batches, 1 + round_index * args.steps, args.steps)
            rates[arm].append(tokens / seconds)
    padded_rate, packed_rate = statistics.median(rates["padded"]), statistics.median(rates["packed"])
    result = {"micro": micro, "padded_fill": round(padded_fill, 3), "packed_fill": round(fill(rows, args.max_len), 3),
              "padded_tokens_per_s": round(padded_rate, 1), "packed_tokens_per_s": round(packed_rate, 1),
              "ratio": round(packed_rate / padded_rate, 2),
              "padding_ratio": round(fill(rows, args.max_len) / padded_fill, 2)}
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--micro", default="2,4,8", help="examples (padded) or rows (packed) a micro batch")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    lengths = long_tailed(args.examples, args.max_len, seed=1)
    examples = examples_of(lengths, args.vocab, seed=2)
    print(json.dumps({"examples": len(examples), "median_length": statistics.median(lengths),
                      "mean_length": round(statistics.mean(lengths), 1), "max_len": args.max_len,
                      "hidden": args.hidden, "layers": args.layers, "threads": args.threads}))
    model = model_for(args)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    results = [compare(model, optimizer, examples, lengths, int(micro), args) for micro in args.micro.split(",")]
    print(f"\ntrained tokens/s, median of {args.rounds} rounds of {args.steps} steps (target: packed >= 2x padded)")
    print(f"{'micro batch':>11} {'padded fill':>11} {'padded':>9} {'packed':>9} {'ratio':>6} {'padding ratio':>13}")
    for r in results:
        print(f"{r['micro']:>11} {r['padded_fill']:>11.0%} {r['padded_tokens_per_s']:>9,.0f} "
              f"{r['packed_tokens_per_s']:>9,.0f} {r['ratio']:>5.2f}x {r['padding_ratio']:>12.2f}x")


if __name__ == "__main__":
    main()
