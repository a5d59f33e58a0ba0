"""The causal LM loss without the whole vocabulary's logits.

transformers' loss makes the logits of every token (a 4096-token sequence at Llama-3's 128k vocabulary:
1 GiB in bf16), casts them to fp32 (2 GiB), takes their log-softmax (2 GiB more) and keeps what the
backward needs. Here the model stops at its last hidden state (`logits_to_keep=1`) and the loss runs
over the tokens a chunk at a time: each chunk's logits live only while its loss and its gradient are
taken, in the forward (the loss is a scalar, so its gradient is known there, as in Liger's fused
linear cross-entropy; Liger's Triton kernel itself measured slower than this on an H200: GPU.md).

Equal to transformers' own loss (`ForCausalLMLoss`, mean over the labelled tokens): the labels shift
left by one, IGNORE (-100) labels count for nothing; a micro batch with no labelled token gives 0.
"""

from __future__ import annotations

from functools import cache

from toolkit.recipe import memory_plan
from toolkit.train.data import IGNORE


def causal_lm_loss(engine, batch: dict):
    """The micro batch's mean loss over its labelled tokens, through the engine (DeepSpeed's hooks
    run as for any forward)."""
    head = engine.module.get_output_embeddings()
    if not plain_head(engine, head):
        return engine(**model_inputs(batch), labels=batch["labels"], use_cache=False).loss
    outputs = engine(**model_inputs(batch), logits_to_keep=1, output_hidden_states=True, use_cache=False)
    hidden = outputs.hidden_states[-1]  # after the final norm: what the head reads
    return linear_cross_entropy(hidden, head.weight, batch["labels"])


LOGIT_CHANGES = ("final_logit_softcapping", "logit_scale", "logits_scaling")  # Gemma 2/3, Cohere, Granite


def plain_head(engine, head) -> bool:
    """Whether the logits are `hidden @ head.weight.T` and nothing more, in bf16 or fp32: else
    transformers' own loss makes them whole, as before. Not plain: a head with a bias or adapters
    (LoRA on lm_head), logits scaled or soft-capped after the head, ZeRO-3's partitioned weight
    (gathered by hooks around the head's own forward only), and fp16, whose loss scale must reach
    the logits' gradient before it is rounded to fp16 (here it is computed in the forward)."""
    kind = type(head)
    if kind.__name__ != "Linear" or kind.__module__ != "torch.nn.modules.linear" or head.bias is not None:
        return False
    config = getattr(engine.module, "config", None)
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in LOGIT_CHANGES):
        return False
    return engine.zero_optimization_stage() != 3 and str(head.weight.dtype) != "torch.float16"


def model_inputs(batch: dict) -> dict:
    """What the model is called with: a packed batch (position ids) goes without its attention mask,
    so that transformers masks each example off from the others (toolkit/train/packing.py)."""
    leave = {"labels", "attention_mask"} if "position_ids" in batch else {"labels"}
    return {key: value for key, value in batch.items() if key not in leave}


def shifted(hidden, labels):
    """Each position's hidden state and the label it predicts (the next token's), flattened."""
    import torch.nn.functional as F

    targets = F.pad(labels, (0, 1), value=IGNORE)[:, 1:]
    return hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)


def linear_cross_entropy(hidden, weight, labels):
    """mean cross-entropy of softmax(hidden @ weight.T) against the shifted labels."""
    rows, targets = shifted(hidden, labels)
    return chunked_function().apply(rows, weight, targets)


def chunk_rows(vocab: int) -> int:
    """Tokens a chunk: its fp32 logits in memory_plan.CHUNK_LOGITS_BYTES (the plan counts the same)."""
    return max(1, memory_plan.CHUNK_LOGITS_BYTES // (4 * vocab))


def _chunked_forward(rows, weight, targets):
    """(loss, d loss / d rows, d loss / d weight or None): one pass over the chunks."""
    import torch

    labelled = targets != IGNORE
    count = labelled.sum().clamp(min=1).float()
    total = torch.zeros((), dtype=torch.float32, device=rows.device)
    grad_rows = torch.empty_like(rows) if rows.requires_grad else None
    grad_weight = torch.zeros_like(weight, dtype=torch.float32) if weight.requires_grad else None
    step = chunk_rows(weight.shape[0])
    for start in range(0, rows.shape[0], step):
        part, wanted, mask = rows[start:start + step], targets[start:start + step], labelled[start:start + step]
        logits = (part @ weight.T).float()  # as the model's head then transformers' loss: bf16, then fp32
        lse = torch.logsumexp(logits, dim=-1)
        picked = wanted.clamp(min=0)
        chosen = logits.gather(1, picked[:, None]).squeeze(1)
        total += ((lse - chosen) * mask).sum()
        if grad_rows is None and grad_weight is None:
            continue
        # d(sum of losses)/d logits = softmax - one_hot, on labelled rows; the mean divides by count.
        probabilities = logits.sub_(lse[:, None]).exp_()
        probabilities[torch.arange(len(picked), device=rows.device), picked] -= 1.0
        probabilities *= (mask.float() / count)[:, None]
        grad_logits = probabilities.to(rows.dtype)
        if grad_rows is not None:
            grad_rows[start:start + step] = grad_logits @ weight
        if grad_weight is not None:
            grad_weight += grad_logits.T.float() @ part.float()
    return total / count, grad_rows, grad_weight


@cache
def chunked_function():
    """The torch.autograd.Function, made on first use (this module imports without torch)."""
    import torch

    class ChunkedLinearCrossEntropy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, rows, weight, targets):
            loss, grad_rows, grad_weight = _chunked_forward(rows, weight, targets)
            ctx.has = (grad_rows is not None, grad_weight is not None)
            ctx.save_for_backward(*(g for g in (grad_rows, grad_weight) if g is not None))
            ctx.weight_dtype = weight.dtype
            return loss

        @staticmethod
        def backward(ctx, grad_loss):
            saved = iter(ctx.saved_tensors)
            grad_rows = next(saved) * grad_loss if ctx.has[0] else None  # a 0-d factor keeps bf16 bf16
            grad_weight = (next(saved) * grad_loss).to(ctx.weight_dtype) if ctx.has[1] else None
            return grad_rows, grad_weight, None

    return ChunkedLinearCrossEntropy
