"""A memory plan before any GPU is spent: what one rank of a recipe holds at its peak, part by part.

On the login node, from the model's shape (its config.json where ft can read it, else a Llama of the
size its name says) and the recipe as resolved: method, ZeRO stage, ranks, micro batch, sequence
length, precision, activation checkpointing. The resolver chooses checkpointing and the ZeRO stage
from it (resolve.py), `ft recipe explain` shows it, and `ft submit` refuses a recipe whose plan does
not fit a rank's memory (a GPU's, or a CPU rank's share of its node), naming what would.

Per rank, in bytes:
  weights      the base model in the training precision (QLoRA: 4-bit NF4 linears, ~0.53 bytes a
               weight with their scales), the adapters; under ZeRO-3 a 1/ranks share of it
  gradients    one per trainable parameter in the training precision; ZeRO-2/3: a 1/ranks share
  optimizer    AdamW's two moments and, in bf16/fp16, an fp32 master copy (12 bytes a trainable
               parameter; 8 in fp32); ZeRO-1/2/3: a 1/ranks share
  activations  what the backward keeps for each token of a micro batch. A Llama layer keeps the
               inputs of its norms and linears, q/k/v after RoPE, attention's output, the MLP's gate,
               up and their product: (6 h + 2 kv + 4 i) values a token (h hidden, kv the key/value
               width, i the MLP's). With activation checkpointing only each layer's input (h), plus
               one layer's whole while it is recomputed. Flash attention keeps no score matrix
  logits       ft's loss a chunk at a time (toolkit/train/losses.py): a chunk of fp32 logits and its
               copy in bf16, and the hidden state's gradient (full fine-tuning: the head's gradient in
               fp32, held from the forward to the backward); transformers' own loss (DPO, ZeRO-3,
               fp16): the whole
               micro batch's logits in the training precision, in fp32, and their log-softmax
  runtime      what the process holds before any of it: a CUDA context on a GPU is outside what
               `max_memory_allocated` counts (0 here); a CPU rank's Python, torch, transformers
               and DeepSpeed (RUNTIME_CPU_BYTES, measured on the lab)

Checked against measured peaks (tests/unit/test_memory_plan.py): an 8B LoRA rank on an H200
(benchmarks/GPU.md) and CPU ranks on this machine, within 20%.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30
CHUNK_LOGITS_BYTES = 256 * 2**20  # one chunk of ft's loss (toolkit/train/losses.py): fp32 logits, 523 tokens at 128k
RUNTIME_CPU_BYTES = int(0.75 * GIB)  # python + torch + transformers + deepspeed imported, on the lab
QLORA_BYTES_PER_WEIGHT = 0.53  # NF4 (0.5) and its double-quantized scales
LORA_TARGETS_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a decoder-only transformer (Llama family and alike)."""
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool = False

    @classmethod
    def from_config(cls, config: dict) -> Shape:
        hidden = int(config["hidden_size"])
        return cls(hidden, int(config.get("intermediate_size", 4 * hidden)), int(config["num_hidden_layers"]),
                   int(config["num_attention_heads"]),
                   int(config.get("num_key_value_heads") or config["num_attention_heads"]),
                   int(config["vocab_size"]), bool(config.get("tie_word_embeddings", False)))

    @classmethod
    def for_size(cls, params_b: float) -> Shape:
        """A Llama of about that many billion parameters (the nearest published shape)."""
        nearest = min(LLAMA_SHAPES, key=lambda size: abs(size - params_b) / size)
        return LLAMA_SHAPES[nearest]

    @property
    def kv_width(self) -> int:
        return self.kv_heads * (self.hidden // self.heads)

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each projection of one layer."""
        h, i, kv = self.hidden, self.intermediate, self.kv_width
        return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def linear_parameters(self) -> int:
        return self.layers * sum(a * b for a, b in self.linears().values())

    def parameters(self) -> int:
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.linear_parameters() + embeddings + self.layers * 2 * self.hidden + self.hidden

    def lora_parameters(self, rank: int, targets: list[str] | tuple[str, ...]) -> int:
        names = {target.rsplit(".", 1)[-1] for target in targets}
        return self.layers * sum(rank * (a + b) for name, (a, b) in self.linears().items() if name in names)


LLAMA_SHAPES = {  # published configs: Llama 3.2 1B/3B, Llama 3.1 8B/70B, Llama 2 13B
    1.2: Shape(2048, 8192, 16, 32, 8, 128256, tied=True),
    3.2: Shape(3072, 8192, 28, 24, 8, 128256, tied=True),
    8.0: Shape(4096, 14336, 32, 32, 8, 128256),
    13.0: Shape(5120, 13824, 40, 40, 40, 32000),
    70.6: Shape(8192, 28672, 80, 64, 8, 128256),
}


@dataclass(frozen=True)
class Setup:
    method: str  # lora, qlora, full
    lora_rank: int
    lora_targets: tuple[str, ...]
    zero_stage: int
    ranks: int
    micro_batch: int
    seq_len: int
    precision: str  # bf16, fp16, fp32
    checkpointing: bool
    ft_loss: bool = True  # ft's chunked loss; False: transformers' (DPO, ZeRO-3)
    on_gpu: bool = True
    rows_per_unit: int = 1  # DPO: a pair is two rows
    packed: bool = False  # packed rows carry an attention mask (toolkit/train/packing.py)


@dataclass(frozen=True)
class MemoryPlan:
    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    runtime: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.runtime

    def parts(self) -> list[tuple[str, int]]:
        return [("weights", self.weights), ("gradients", self.gradients), ("optimizer state", self.optimizer),
                ("activations", self.activations), ("logits (loss)", self.logits), ("runtime", self.runtime)]


def value_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def estimate(shape: Shape, setup: Setup) -> MemoryPlan:
    width = value_bytes(setup.precision)
    ranks = max(1, setup.ranks)
    if setup.method == "full":
        trainable = shape.parameters()
        base = 0.0
    else:
        trainable = shape.lora_parameters(setup.lora_rank, setup.lora_targets)
        linear = shape.linear_parameters()
        base = ((shape.parameters() - linear) * width + linear * QLORA_BYTES_PER_WEIGHT
                if setup.method == "qlora" else shape.parameters() * width)
    weights = base + trainable * width
    if setup.zero_stage == 3:
        weights = weights / ranks + layer_bytes(shape, width)  # one layer gathered at a time
    gradients = trainable * width / (ranks if setup.zero_stage >= 2 else 1)
    optimizer = trainable * (8 + (4 if setup.precision != "fp32" else 0)) / (ranks if setup.zero_stage >= 1 else 1)
    tokens = setup.micro_batch * setup.seq_len * setup.rows_per_unit
    per_token_layer = 6 * shape.hidden + 2 * shape.kv_width + 4 * shape.intermediate
    if setup.method != "full":
        per_token_layer += setup.lora_rank * len(setup.lora_targets)
    if setup.checkpointing:
        activations = tokens * width * (shape.layers * shape.hidden + per_token_layer)
    else:
        activations = tokens * width * shape.layers * per_token_layer
    if setup.packed and not setup.on_gpu:  # a CPU's attention under a mask keeps its scores (heads x seq^2)
        activations += shape.layers * setup.micro_batch * setup.rows_per_unit * shape.heads * setup.seq_len ** 2 * 4
    if setup.ft_loss:
        # a chunk's fp32 logits, beside them its head output (bf16) or its gradient in the training
        # precision (fp32 needs no second copy), and the hidden state's gradient
        chunk = min(CHUNK_LOGITS_BYTES, tokens * shape.vocab * 4)
        logits = int(chunk * (1 + (width / 4 if width < 4 else 0))) + tokens * shape.hidden * width
        if setup.method == "full":  # the head's gradient, fp32 from the forward, then scaled and cast
            logits += shape.vocab * shape.hidden * (4 + 4 + width)
    else:
        logits = tokens * shape.vocab * (width + 4 + 4)
    runtime = 0 if setup.on_gpu else RUNTIME_CPU_BYTES
    return MemoryPlan(int(weights), int(gradients), int(optimizer), int(activations), int(logits), runtime)


def layer_bytes(shape: Shape, width: int) -> int:
    return sum(a * b for a, b in shape.linears().values()) * width


def shape_of(base: str, params_b: float | None) -> Shape | None:
    """The model's shape: its config.json where `base` is a folder ft can read, else a Llama of the
    size given (None: no plan)."""
    config = Path(base) / "config.json"
    try:
        if config.is_file():
            return Shape.from_config(json.loads(config.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return Shape.for_size(params_b) if params_b else None


def gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"
