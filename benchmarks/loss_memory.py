"""Peak memory of one training step's loss at Llama-3's 128k vocabulary: transformers' loss (the whole
vocabulary's logits, in fp32, then log-softmax) against ft's (toolkit/train/losses.py: the tokens a
chunk at a time, each chunk's gradient taken in the forward). Target (issue 35): ft's peak <= 0.25x.

Each variant runs in its own process on the CPU: a final hidden state [1, tokens, hidden] that needs a
gradient (what the decoder hands the head), the head's weight [vocab, hidden] (frozen, as under LoRA;
--full trains it), labels; then loss and backward. What is measured is the process's peak resident
memory (ru_maxrss) above what it held once its inputs existed: the memory the loss itself takes.
The two variants alternate, --rounds times; their losses and input gradients are compared (1e-4).

    python benchmarks/loss_memory.py [--tokens 4096] [--hidden 1024] [--vocab 128256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

STEP = r"""
import json, resource, sys
import torch
sys.path.insert(0, sys.argv[1])
from toolkit.train.losses import linear_cross_entropy
variant, full = sys.argv[2], sys.argv[6] == "1"
tokens, hidden_size, vocab = (int(value) for value in sys.argv[3:6])
torch.set_num_threads(2)
generator = torch.Generator().manual_seed(0)
hidden = (torch.randn(1, tokens, hidden_size, generator=generator) * 0.5).requires_grad_()
weight = (torch.randn(vocab, hidden_size, generator=generator) * 0.02).requires_grad_(full)
labels = torch.randint(0, vocab, (1, tokens), generator=generator)
labels[0, : tokens // 8] = -100  # a prompt, masked from the loss
# The page tables and allocator of a first matmul and a first backward, not the loss's: warm them.
warm = (hidden[:, :8] @ weight[:64].T).sum(); warm.backward(); hidden.grad = None; weight.grad = None
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if variant == "transformers":
    from transformers.loss.loss_utils import ForCausalLMLoss
    logits = hidden @ weight.T  # what LlamaForCausalLM's head makes
    loss = ForCausalLMLoss(logits, labels, vocab_size=vocab)
else:
    loss = linear_cross_entropy(hidden, weight, labels)
loss.backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"variant": variant, "loss": loss.item(), "peak_above_inputs_mib": (peak - before) / 1024,
                  "grad_sum": hidden.grad.double().abs().sum().item(),
                  "grad_head": hidden.grad[0, tokens // 2, :4].tolist()}))
"""


def measure(variant: str, args) -> dict:
    out = subprocess.run([sys.executable, "-c", STEP, str(REPO), variant, str(args.tokens), str(args.hidden),
                          str(args.vocab), "1" if args.full else "0"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024, help="the logits' size does not depend on it")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--full", action="store_true", help="the head trains too (full fine-tuning)")
    args = parser.parse_args()
    peaks: dict[str, list[float]] = {"transformers": [], "ft": []}
    for _ in range(args.rounds):
        results = {variant: measure(variant, args) for variant in peaks}
        for variant, result in results.items():
            peaks[variant].append(result["peak_above_inputs_mib"])
        a, b = results["transformers"], results["ft"]
        same_loss = abs(a["loss"] - b["loss"]) <= 1e-4
        pairs = zip(a["grad_head"], b["grad_head"], strict=True)
        same_grad = any(a["grad_head"]) and all(abs(x - y) <= 1e-4 * max(1.0, abs(x)) for x, y in pairs)
        print(json.dumps({"transformers": a, "ft": b, "same_loss_1e-4": same_loss, "same_grad_1e-4": same_grad}))
        if not (same_loss and same_grad):
            raise SystemExit("ft's loss does not match transformers' loss")
    mine, theirs = statistics.median(peaks["ft"]), statistics.median(peaks["transformers"])
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    print(f"\n{args.tokens} tokens x {args.vocab} vocabulary (fp32 logits: {logits_mib:,.0f} MiB), "
          f"head {'trained' if args.full else 'frozen'}, {args.rounds} rounds, peak above the inputs (median):")
    print(f"  transformers' loss  {theirs:8,.0f} MiB   {peaks['transformers']}")
    print(f"  ft's loss           {mine:8,.0f} MiB   {peaks['ft']}")
    print(f"  ratio ft / transformers: {mine / theirs:.3f}   (target <= 0.25)")


if __name__ == "__main__":
    main()
