"""LoRA fine-tuning throughput of a Llama-3-8B-shaped model (random weights, random tokens) on one GPU.

Three ways to train the same shape, each timed after warm-up steps (torch.cuda.synchronize around the
timed steps):

  peft       the bare loop: transformers + peft + torch AdamW, nothing else (the reference)
  deepspeed  ft's runtime path in this process: deepspeed.init_distributed (NCCL on a GPU) and
             deepspeed.initialize with toolkit.train.engine.deepspeed_config (bf16, ZeRO-2), batches from the
             worker's collate, engine forward/backward/step. Then probes of the worker's own statements
             on this backend (a CPU batch into the engine, an all_reduce of a CPU tensor, flash attention
             with the attention mask the worker passes)
  worker     the real ft worker (python -m toolkit.train.worker) on a saved random model, a token cache
             built from generated text and a recipe.json; timed from the metrics.jsonl line it writes per step

Every configuration prints one line `RESULT {json}`: tokens/s/GPU, peak GPU memory, model TFLOP/s, MFU,
and the ratio to NeMo's published Llama2-7B LoRA figure (24,824 tokens/s/GPU: NeMo 24.07, DGX-H100, FP8,
8 GPUs, GBS 32, MBS 1, packed sequence length 4096; docs/source/performance/performance_summary.md).

FLOPs per token (LoRA): the frozen base costs 4*N (forward 2N, backward to the activations 2N, no weight
gradients), N = the weights of every matmul (projections and lm_head); the adapters cost 6*N_lora; causal
attention costs 6*s*h*L (forward 2*s*h per layer, backward twice that). 'model TFLOP/s (4N)' counts 4*N
alone, the convention NeMo's 663 TFLOP/s/GPU for its 24,824 tokens/s matches (24,824 * 4 * 6.6e9).

  python benchmarks/gpu_lora.py                                  # H100: 8B shape, seq 4096, peft + deepspeed
  python benchmarks/gpu_lora.py --modes worker                   # the real worker at the same shape
  python benchmarks/gpu_lora.py --configs mb1,gc+mb4,compile+mb1 # gradient checkpointing, torch.compile
  python benchmarks/gpu_lora.py --tiny                           # CPU smoke test of every mode (gloo, fp32)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

NEMO_LLAMA2_7B_LORA = 24_824  # tokens/s/GPU, H100, FP8
H100_BF16_DENSE_TFLOPS = 989.4
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256}
LLAMA2_7B = {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "vocab_size": 32000}
TINY = {"hidden_size": 64, "intermediate_size": 224, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512}


# --- arithmetic ------------------------------------------------------------------------------------

def module_shapes(shape: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of one decoder layer."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * (h // shape["num_attention_heads"])
    return {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def matmul_params(shape: dict) -> int:
    layer = sum(a * b for a, b in module_shapes(shape).values())
    return shape["num_hidden_layers"] * layer + shape["vocab_size"] * shape["hidden_size"]


def lora_params(shape: dict, rank: int, targets: list[str]) -> int:
    layer = sum(rank * (a + b) for name, (a, b) in module_shapes(shape).items() if name in targets)
    return shape["num_hidden_layers"] * layer


def flops_per_token(shape: dict, seq: int, rank: int, targets: list[str]) -> dict[str, float]:
    base = 4 * matmul_params(shape)
    adapters = 6 * lora_params(shape, rank, targets)
    attention = 6 * seq * shape["hidden_size"] * shape["num_hidden_layers"]
    return {"base_4n": base, "total": base + adapters + attention}


def figures(tokens: int, seconds: float, shape: dict, seq: int, rank: int, targets: list[str],
            peak_tflops: float) -> dict:
    rate = tokens / seconds
    ours = flops_per_token(shape, seq, rank, targets)
    theirs = flops_per_token(LLAMA2_7B, 4096, rank, targets)
    equivalent = rate * ours["total"] / theirs["total"]  # Llama2-7B tokens/s at the same FLOP/s
    return {"tokens_per_s_gpu": round(rate, 1),
            "model_tflops_4n": round(rate * ours["base_4n"] / 1e12, 1),
            "model_tflops_total": round(rate * ours["total"] / 1e12, 1),
            "mfu": round(rate * ours["total"] / (peak_tflops * 1e12), 4),
            "ratio_to_nemo_24824": round(rate / NEMO_LLAMA2_7B_LORA, 3),
            "llama2_7b_equivalent_tokens_per_s": round(equivalent, 1),
            "llama2_7b_equivalent_ratio_to_nemo": round(equivalent / NEMO_LLAMA2_7B_LORA, 3)}


def report(result: dict) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def parse_config(token: str) -> dict:
    """'mb2', 'gc+mb4', 'compile+mb1', 'gc+compile+mb2'."""
    parts = token.split("+")
    micro = [p for p in parts if p.startswith("mb")]
    if len(micro) != 1 or not set(parts) - set(micro) <= {"gc", "compile", "eager"}:
        raise SystemExit(f"bad configuration {token!r}: use mbN with optional gc+, compile+ or eager+ prefixes")
    # compile: True (compile+), False (eager+), None: the worker's default (on on a GPU)
    chosen = True if "compile" in parts else False if "eager" in parts else None
    return {"name": token, "micro_batch": int(micro[0][2:]), "gc": "gc" in parts, "compile": chosen}


# --- model ------------------------------------------------------------------------------------------

def llama_config(shape: dict, seq: int):
    from transformers import LlamaConfig

    # Token ids 0/1/2 are the bos/eos/pad of toolkit.train.tiny's tokenizer (the worker mode uses it).
    return LlamaConfig(**shape, max_position_embeddings=max(8192, seq), rms_norm_eps=1e-5, bos_token_id=0,
                       eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)


def build_model(shape: dict, seq: int, device: str, dtype):
    """Random weights, created on the device in the training dtype (no fp32 copy on the host)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    started = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(llama_config(shape, seq), dtype=dtype, attn_implementation="sdpa")
    model.config.use_cache = False  # as ft's worker: HF's cache is for generation (under compile it recompiled)
    print(f"model built on {device} in {dtype} in {time.perf_counter() - started:.1f} s: "
          f"{sum(p.numel() for p in model.parameters()) / 1e9:.3f} B parameters", flush=True)
    return model


def add_lora(model, rank: int, alpha: float, targets: list[str], adapter_dtype: str = "base"):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, task_type="CAUSAL_LM")
    # 'base': adapters in the base model's dtype, what ft's DeepSpeed path ends with (it casts the whole
    # module); 'fp32': peft's default (adapters kept in fp32 under a bf16 base).
    model = get_peft_model(model, config, autocast_adapter_dtype=adapter_dtype == "fp32")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"LoRA r={rank} alpha={alpha} on {','.join(targets)}: {trainable / 1e6:.1f} M trainable", flush=True)
    return model


def set_checkpointing(model, enabled: bool) -> None:
    if enabled:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()


def compile_layers(model) -> None:
    """Regional compilation: each decoder layer (they share one compiled graph)."""
    for layer in model.base_model.model.model.layers:
        layer.compile()


def flash_available(model, device: str, vocab: int, with_mask: bool) -> str:
    """Whether a forward runs with SDPA restricted to the flash kernel (the mask as the worker passes it)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device != "cuda":
        return "n/a (cpu)"
    ids = torch.randint(0, vocab, (1, 256), device=device)
    kwargs = {"attention_mask": torch.ones_like(ids)} if with_mask else {}
    try:
        with torch.no_grad(), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            model(input_ids=ids, **kwargs)
        return "yes"
    except RuntimeError as exc:
        return f"no ({str(exc).splitlines()[0][:160]})"


def memory_fields(device: str) -> dict:
    import torch

    if device != "cuda":
        return {}
    return {"peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2)}


def timed(step, warmup: int, steps: int, sync) -> float:
    for _ in range(warmup):
        step()
    sync()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return time.perf_counter() - started


GEMM_KERNELS = ("gemm", "nvjet", "cutlass", "xmma", "matmul", "cublas")
ATTENTION_KERNELS = ("flash", "fmha", "attention")


def profile_steps(step, args, label: str) -> None:
    """torch.profiler over `args.profile` steps: where the device's time goes (matrix products,
    attention, the rest), how busy it is against the wall clock, the costliest kernels and host
    calls; the timeline saved for chrome://tracing / Perfetto under $OUT (the device tool's) or --workdir."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not args.profile:
        return
    args.sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(args.profile):
            step()
        args.sync()
        wall = time.perf_counter() - started
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    share = {"gemm": 0.0, "attention": 0.0, "other": 0.0}
    for event in kernels:
        name = event.key.lower()
        kind = ("gemm" if any(k in name for k in GEMM_KERNELS) else
                "attention" if any(k in name for k in ATTENTION_KERNELS) else "other")
        share[kind] += event.self_device_time_total / 1e3 / args.profile
    busy = sum(share.values())
    wall_ms = wall * 1e3 / args.profile
    report({"mode": "profile", "of": label, "steps": args.profile, "wall_ms_per_step": round(wall_ms, 1),
            "device_busy_ms_per_step": round(busy, 1), "device_idle_share": round(1 - busy / wall_ms, 3),
            "kernels_per_step": round(sum(e.count for e in kernels) / args.profile),
            **{f"{kind}_ms_per_step": round(ms, 1) for kind, ms in share.items()}})
    sort = "self_device_time_total" if args.device == "cuda" else "self_cpu_time_total"
    table = prof.key_averages()
    print(f"--- profile {label}: by device time ---\n" + table.table(sort_by=sort, row_limit=args.profile_rows))
    print(f"--- profile {label}: by host time ---\n" + table.table(sort_by="self_cpu_time_total",
                                                                  row_limit=args.profile_rows), flush=True)
    folder = os.environ.get("OUT") or args.workdir
    if folder:
        import gzip

        trace = Path(folder) / f"trace-{label}.json"
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as raw, gzip.open(f"{trace}.gz", "wb") as packed:
            packed.write(raw.read())
        trace.unlink()


def free(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# --- peft: the bare loop ---------------------------------------------------------------------------

def run_peft(model, args, config: dict, compiled: bool) -> None:
    import torch

    device = args.device
    set_checkpointing(model, config["gc"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0)
    batches = [torch.randint(0, args.shape["vocab_size"], (config["micro_batch"], args.seq), device=device)
               for _ in range(2)]
    state = {"i": 0}

    def step():
        ids = batches[state["i"] % 2]
        state["i"] += 1
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # no KV cache (compile recompiles)
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result = {"mode": "peft", "config": config["name"], "micro_batch": config["micro_batch"], "seq": args.seq,
              "adapter_dtype": args.adapter_dtype, "gradient_checkpointing": config["gc"], "compile": compiled,
              "layers": args.shape["num_hidden_layers"]}
    free(device)
    try:
        seconds = timed(step, args.warmup, args.steps, args.sync)
    except torch.OutOfMemoryError as exc:
        result["error"] = f"OutOfMemoryError: {str(exc).splitlines()[0][:200]}"
    else:
        tokens = args.steps * config["micro_batch"] * args.seq
        result.update(step_s=round(seconds / args.steps, 4), **memory_fields(device),
                      **figures(tokens, seconds, args.shape, args.seq, args.rank, args.targets, args.peak_tflops))
        report(result)
        profile_steps(step, args, f"bare-{config['name']}")
        result = None
    optimizer.state.clear()
    batches.clear()
    model.zero_grad(set_to_none=True)
    free(device)
    if result is not None:
        report(result)


# --- deepspeed: ft's runtime path in this process --------------------------------------------------

def spec_for(model_path: str, data_path: str, args, config: dict, steps: int) -> dict:
    """A run spec as toolkit.train.worker reads it (recipe.json): LoRA, bf16 (fp32 on a CPU), --zero-stage, one rank."""
    from toolkit.recipe.run_spec import batch_plan
    from toolkit.recipe.schema import TrainingSpec

    retry = batch_plan(TrainingSpec(micro_batch=config["micro_batch"], global_batch=config["micro_batch"]), 1, True)
    derived = {"workers_per_node": 1, "world_size": 1, "gradient_accumulation": 1,
               "out_of_memory_micro_batch": retry.micro_batch, "partition": "bench", "qos": None}
    return {"derived": derived, "recipe": {
        "name": "gpu-lora-bench", "model": {"base": model_path, "revision": None, "params_b": None},
        "method": {"kind": "lora", "rank": args.rank, "alpha": args.alpha, "dropout": 0.0,
                   "target_modules": args.targets},
        "objective": {"kind": "sft", "beta": None},
        "data": {"train": data_path, "eval": None, "format": "prompt_completion", "max_seq_len": args.seq,
                 "eval_fraction": 0.0, "too_long": "truncate"},
        "training": {"steps": steps, "epochs": None, "learning_rate": 1e-4, "lr_schedule": "constant",
                     "warmup_steps": 0, "micro_batch": config["micro_batch"], "global_batch": config["micro_batch"],
                     "precision": "bf16" if args.device == "cuda" else "fp32", "seed": 42,
                     "zero_stage": args.zero_stage,
                     "gradient_checkpointing": config["gc"], "max_grad_norm": 1.0}
        | ({} if config["compile"] is None else {"compile": config["compile"]}),  # today's code has no such key
        "checkpoint": {"every_steps": None, "every_minutes": None, "keep_last": 1, "staging": None,
                       "s3_mirror": None},
        "tracking": {"wandb": {"project": None, "entity": None, "mode": "disabled", "tags": []}},
        "env": {},
    }}


def distributed_env(args) -> dict:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "FT_DIST_BACKEND": "nccl" if args.device == "cuda" else "gloo"}
    if args.device != "cuda":
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    return env


def run_deepspeed(model, args, config: dict) -> None:
    import torch

    os.environ.update(distributed_env(args))
    import deepspeed
    import torch.distributed as dist

    from toolkit.recipe.run_spec import RunSpec, batch_plan
    from toolkit.train.data import Example, collate
    from toolkit.train.engine import deepspeed_config
    from toolkit.train.losses import causal_lm_loss

    backend = os.environ["FT_DIST_BACKEND"]
    deepspeed.init_distributed(dist_backend=backend)  # as the worker does
    set_checkpointing(model, config["gc"])
    total = args.warmup + args.steps
    training = RunSpec.model_validate(spec_for("unused", "unused", args, config, total)).recipe.training
    ds_config = deepspeed_config(training, batch_plan(training, dist.get_world_size()), total)
    for key, value in json.loads(args.ds_extra).items():  # e.g. {"bf16": {"enabled": true}}: today's before
        ds_config[key] = value
    if config["compile"]:
        compile_layers(model)
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    micro = ds_config["train_micro_batch_size_per_gpu"]
    generator = random.Random(0)
    examples = [Example([generator.randrange(3, args.shape["vocab_size"]) for _ in range(args.seq)], [])
                for _ in range(2 * micro)]
    examples = [Example(e.input_ids, list(e.input_ids)) for e in examples]
    pad = 2
    state = {"i": 0, "tokens": 0}

    def step():
        part = examples[(state["i"] % 2) * micro:(state["i"] % 2 + 1) * micro]
        state["i"] += 1
        batch = collate(part, pad)
        state["tokens"] += int(batch["attention_mask"].sum())
        batch = {key: value.to(engine.device) for key, value in batch.items()}
        loss = causal_lm_loss(engine, batch) if args.ft_loss else engine(**batch).loss
        engine.backward(loss)
        engine.step()

    base_param = next(p for n, p in engine.module.named_parameters() if "lora_" not in n)
    lora_param = next(p for n, p in engine.module.named_parameters() if "lora_" in n)
    result = {"mode": "deepspeed", "config": config["name"], "micro_batch": micro, "seq": args.seq,
              "gradient_checkpointing": config["gc"], "compile": bool(config["compile"]),
              "layers": args.shape["num_hidden_layers"], "backend": backend,
              "zero_stage": ds_config["zero_optimization"]["stage"], "bf16": ds_config.get("bf16"),
              "ft_loss": args.ft_loss, "engine_device": str(engine.device),
              "local_rank_env": os.environ.get("LOCAL_RANK"), "base_param": f"{base_param.dtype}@{base_param.device}",
              "lora_param": f"{lora_param.dtype}@{lora_param.device}"}
    free(args.device)
    try:
        seconds = timed(step, args.warmup, args.steps, args.sync)
    except torch.OutOfMemoryError as exc:
        result["error"] = f"OutOfMemoryError: {str(exc).splitlines()[0][:200]}"
    else:
        tokens = args.steps * micro * args.seq
        result.update(step_s=round(seconds / args.steps, 4), **memory_fields(args.device),
                      **figures(tokens, seconds, args.shape, args.seq, args.rank, args.targets, args.peak_tflops))
    report(result)
    profile_steps(step, args, args.label or f"deepspeed-{config['name']}")
    if not args.probes:
        return

    # The worker's own statements as they stood before the fix, on this backend.
    probes = {}
    try:
        engine(**collate(examples[:1], pad))  # a batch left on the host, as collate makes it
        probes["cpu_batch_into_engine"] = "ok"
    except Exception as exc:  # noqa: BLE001 - reported, not handled
        probes["cpu_batch_into_engine"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    try:
        signals = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)  # the worker's per-step collective
        dist.all_reduce(signals)
        probes["all_reduce_cpu_float64"] = "ok"
    except Exception as exc:  # noqa: BLE001 - a probe: whatever the backend raises is the finding
        probes["all_reduce_cpu_float64"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    probes["flash_with_attention_mask"] = flash_available(engine.module, args.device, args.shape["vocab_size"], True)
    probes["flash_without_mask"] = flash_available(engine.module, args.device, args.shape["vocab_size"], False)
    report({"mode": "deepspeed-probes", **probes})


# --- worker: the real ft worker ---------------------------------------------------------------------

def write_worker_inputs(work: Path, args) -> tuple[Path, Path]:
    """A model folder (random weights saved in the training dtype, tiny tokenizer) and a JSONL of
    prompt/completion rows longer than the sequence length (truncated to it by the recipe). Kept in
    `work` and reused by later runs of the same shape (--workdir): an 8B model takes 25 s to save."""
    import torch

    from toolkit.data.tiny_tokenizer import TINY_CORPUS
    from toolkit.train.tiny import build_tokenizer

    model_dir, data = work / "model", work / "train.jsonl"
    if (model_dir / "config.json").exists() and data.exists():
        return model_dir, data
    tokenizer = build_tokenizer(model_dir)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build_model(args.shape, args.seq, args.device, dtype)
    started = time.perf_counter()
    model.save_pretrained(model_dir)
    print(f"model saved in {time.perf_counter() - started:.1f} s "
          f"({sum(f.stat().st_size for f in model_dir.glob('*.safetensors')) / 2**30:.2f} GiB)", flush=True)
    del model
    free(args.device)

    generator = random.Random(0)
    rows = []
    for _ in range(max(16, 2 * args.worker_config["micro_batch"])):
        words = []
        while True:
            words.extend(generator.choice(TINY_CORPUS) for _ in range(200))
            text = " " + " ".join(words)
            if len(tokenizer(text)["input_ids"]) > args.seq + 8:
                break
        rows.append({"prompt": "Continue:", "completion": text})
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return model_dir, data


def inputs_folder(args) -> Path:
    shape = "-".join(str(args.shape[k]) for k in sorted(args.shape))
    return Path(args.workdir or tempfile.gettempdir()) / f"ft-gpu-lora-inputs-{shape}-{args.seq}"


def new_run(work: Path, name: str, spec: dict, args) -> Path:
    run_dir = work / "shared" / "runs" / name
    (run_dir / "logs").mkdir(parents=True)
    site = {"distributed_backend": "nccl" if args.device == "cuda" else "gloo"}  # as ft render writes it
    (run_dir / "recipe.json").write_text(json.dumps(spec | {"site": site}))
    return run_dir


def start_worker(args, run_dir: Path, repo: Path, stop_after_step: int = 0) -> dict:
    """One start of `python -m toolkit.train.worker` from `repo` on `run_dir`: its exit status, the
    time each step's metrics line appeared, its peak host memory (VmHWM, polled), the GPU's memory in
    use at its peak. With stop_after_step, SIGUSR2 (Slurm's warning before the time limit) once that
    step's line appears: the worker checkpoints and leaves for a requeue."""
    import signal

    import torch

    env = dict(os.environ, **distributed_env(args), FT_RUN_DIR=str(run_dir), FT_RUN_ID=run_dir.name,
               PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))
    metrics = run_dir / "metrics.jsonl"
    seen: list[tuple[float, dict]] = []
    earlier = len(metrics.read_text().splitlines()) if metrics.exists() else 0  # an earlier start's lines
    peaks = {"device_used": 0, "host_hwm_kib": 0, "RssAnon": 0, "RssFile": 0}
    done = threading.Event()
    log_path = run_dir / "logs" / f"rank-0.{len(list(run_dir.glob('logs/rank-0.*')))}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-u", "-m", "toolkit.train.worker"], env=env, cwd=repo,
                                   stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        def watch():  # the time each step's metrics line appears, peak memories
            stopped = False
            while not done.is_set():
                if metrics.exists():
                    lines = metrics.read_text().splitlines()[earlier:]
                    now = time.perf_counter()
                    for line in lines[len(seen):]:
                        if line.endswith("}"):
                            seen.append((now, json.loads(line)))
                    if stop_after_step and not stopped and seen and seen[-1][1]["step"] >= stop_after_step:
                        process.send_signal(signal.SIGUSR2)
                        stopped = True
                try:
                    status = Path(f"/proc/{process.pid}/status").read_text()
                    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
                    peaks["host_hwm_kib"] = max(peaks["host_hwm_kib"], int(fields["VmHWM"].split()[0]))
                    for key in ("RssAnon", "RssFile"):  # the rank's own memory; mapped files (shared page cache)
                        peaks[key] = max(peaks[key], int(fields[key].split()[0]))
                except (OSError, StopIteration, ValueError):
                    pass
                if args.device == "cuda":
                    free_bytes, total_bytes = torch.cuda.mem_get_info()
                    peaks["device_used"] = max(peaks["device_used"], total_bytes - free_bytes)
                time.sleep(0.005)

        watcher = threading.Thread(target=watch, daemon=True)
        started = time.perf_counter()
        watcher.start()
        try:
            code = process.wait(timeout=args.worker_timeout)
        finally:
            if process.poll() is None:
                process.kill()
            done.set()
            watcher.join()
    log_lines = log_path.read_text(errors="replace").splitlines()
    print(f"--- worker log ({log_path.name}), last lines ---")
    print("\n".join(line[:300] for line in log_lines[-args.log_lines:]))
    print("---", flush=True)
    return {"exit": code, "wall_s": round(time.perf_counter() - started, 1), "seen": seen,
            "worker_peak_rss_gib": round(peaks["host_hwm_kib"] / 2**20, 2),
            "worker_peak_anon_gib": round(peaks["RssAnon"] / 2**20, 2),
            "worker_peak_file_mapped_gib": round(peaks["RssFile"] / 2**20, 2),
            "device_peak_used_gib": round(peaks["device_used"] / 2**30, 2) if args.device == "cuda" else None}


def run_worker(args) -> None:
    """The worker's throughput at the shape, from the repo given (--worker-repo: today's code beside
    the new, e.g. a `git worktree` of an older commit)."""
    config = args.worker_config
    total = args.warmup + args.steps
    repo = Path(args.worker_repo).resolve()
    inputs = inputs_folder(args)
    inputs.mkdir(parents=True, exist_ok=True)
    model_dir, data = write_worker_inputs(inputs, args)
    with tempfile.TemporaryDirectory(prefix="ft-gpu-lora-", dir=args.workdir) as tmp:
        spec = spec_for(str(model_dir), str(data), args, config, total)
        spec["recipe"]["eval"] = {"enabled": False}
        # A metrics line per step, each read after its step ended on the GPU (the loss read waits for
        # it): the lines' arrival times the steps. Batched lines (the default, every 10) would not.
        spec["recipe"]["tracking"]["log_every_steps"] = 1
        run_dir = new_run(Path(tmp), "bench", spec, args)
        start = start_worker(args, run_dir, repo)
        seen, code = start.pop("seen"), start["exit"]
        result = {"mode": "worker", "label": args.label or repo.name, "config": config["name"],
                  "micro_batch": config["micro_batch"], "seq": args.seq, "gradient_checkpointing": config["gc"],
                  "compile": "default" if config["compile"] is None else config["compile"],
                  "layers": args.shape["num_hidden_layers"], "backend": distributed_env(args)["FT_DIST_BACKEND"],
                  **start}
        summary = run_dir / "summary.json"
        if summary.exists():
            result["summary"] = {k: v for k, v in json.loads(summary.read_text()).items() if k != "loss_curve"}
        if len(seen) >= args.warmup + args.steps and code == 0:
            (t0, first), (t1, last) = seen[args.warmup - 1], seen[args.warmup + args.steps - 1]
            tokens = last["tokens"] - first["tokens"]
            result.update(timed_steps=args.steps, tokens=tokens, step_s=round((t1 - t0) / args.steps, 4),
                          **figures(tokens, t1 - t0, args.shape, args.seq, args.rank, args.targets, args.peak_tflops))
        else:
            result["error"] = f"worker exit {code}, {len(seen)} metrics lines"
        report(result)


def adapter_weights(output: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(output / "adapter_model.safetensors"))


def run_lifecycle(args) -> None:
    """One rank's whole ft run on this device (NCCL, bf16, the defaults): trained straight through;
    and trained again with a stop (SIGUSR2) part way, resumed from the checkpoint it wrote; the two
    runs' adapters compared, the evaluation and the export checked."""
    repo = Path(args.worker_repo).resolve()
    total = args.lifecycle_steps
    inputs = inputs_folder(args)
    inputs.mkdir(parents=True, exist_ok=True)
    model_dir, data = write_worker_inputs(inputs, args)
    config = dict(args.worker_config, micro_batch=1)
    with tempfile.TemporaryDirectory(prefix="ft-gpu-lifecycle-", dir=args.workdir) as tmp:
        spec = spec_for(str(model_dir), str(data), args, config, total)
        spec["recipe"]["data"]["eval_fraction"] = 0.25  # held out, evaluated before and after
        spec["recipe"]["checkpoint"] = dict(spec["recipe"]["checkpoint"], every_steps=None, every_minutes=None)
        spec["recipe"]["tracking"]["log_every_steps"] = 1  # a line a step: the stop lands where asked
        straight = new_run(Path(tmp), "straight", spec, args)
        first = start_worker(args, straight, repo)
        if args.lifecycle_twice:  # the GPU's own run-to-run spread: the floor for "equal weights"
            again_straight = new_run(Path(tmp), "straight-again", spec, args)
            start_worker(args, again_straight, repo)
        resumed = new_run(Path(tmp), "resumed", spec, args)
        stopped = start_worker(args, resumed, repo, stop_after_step=max(1, total // 3))
        again = start_worker(args, resumed, repo)
        result = {"mode": "lifecycle", "steps": total, "seq": args.seq, "layers": args.shape["num_hidden_layers"],
                  "straight_exit": first["exit"], "stopped_exit": stopped["exit"], "resumed_exit": again["exit"],
                  "stopped_at_step": stopped["seen"][-1][1]["step"] if stopped["seen"] else None,
                  "resumed_from_step": again["seen"][0][1]["step"] - 1 if again["seen"] else None}
        try:
            a, b = adapter_weights(straight / "output"), adapter_weights(resumed / "output")
            result["adapter_tensors"] = len(a)
            result["adapters_equal"] = a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
            result["adapter_max_abs_diff"] = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
        except (OSError, KeyError, ValueError) as exc:
            result["adapters_equal"] = f"{type(exc).__name__}: {exc}"
        if args.lifecycle_twice:
            a, b = adapter_weights(straight / "output"), adapter_weights(again_straight / "output")
            result["straight_twice_max_abs_diff"] = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
        for name, run in (("straight", straight), ("resumed", resumed)):
            summary = run / "summary.json"
            if summary.exists():
                values = json.loads(summary.read_text())
                result[f"{name}_summary"] = {k: values.get(k) for k in ("steps", "final_loss", "checkpoints",
                                                                        "peak_device_memory_gib")}
            from toolkit.runs.layout import RunLayout

            evaluation = RunLayout(run).evaluation
            if evaluation.exists():
                values = json.loads(evaluation.read_text())
                result[f"{name}_evaluation"] = {k: v for k, v in values.items() if not isinstance(v, (list, dict))
                                                or k in ("sets", "verdict")}
            output = run / "output"
            result[f"{name}_export"] = sorted(f.name for f in output.glob("*")) if output.is_dir() else []
        report(result)


# --- main -------------------------------------------------------------------------------------------

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU (smoke test)")
    parser.add_argument("--modes", default="peft,deepspeed", help="comma list of peft, deepspeed, worker, lifecycle")
    parser.add_argument("--configs", default="mb1,mb2,gc+mb4,gc+mb8", help="peft configurations, e.g. gc+mb4")
    parser.add_argument("--ds-config", default="mb1", help="the deepspeed mode's configuration")
    parser.add_argument("--worker-config", default="mb1", help="the worker mode's configuration")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (4096; tiny: 64)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (32; tiny: 2)")
    parser.add_argument("--rank", type=int, default=32, help="LoRA rank (NeMo's default: 32)")
    parser.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha (NeMo's default: 32)")
    parser.add_argument("--targets", default=",".join(ALL_LINEAR), help="LoRA target modules")
    parser.add_argument("--adapter-dtype", choices=["base", "fp32"], default="base",
                        help="peft mode: adapters in the base dtype (as ft's DeepSpeed path) or fp32 (peft's default)")
    parser.add_argument("--zero-stage", type=int, default=1,
                        help="ZeRO stage of the deepspeed and worker modes (1: what ft's resolver picks for adapters)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--peak-tflops", type=float, default=H100_BF16_DENSE_TFLOPS, help="for MFU (H100 SXM bf16)")
    parser.add_argument("--workdir", default=None, help="where the worker mode writes its model and run")
    parser.add_argument("--worker-timeout", type=int, default=1800)
    parser.add_argument("--log-lines", type=int, default=25)
    parser.add_argument("--worker-repo", default=str(REPO), help="the ft checkout whose worker runs (today's code "
                                                                  "beside the new: a worktree of an older commit)")
    parser.add_argument("--label", default="", help="names the worker/deepspeed result and its profile")
    parser.add_argument("--ds-extra", default="{}", help="JSON merged into the deepspeed mode's configuration")
    parser.add_argument("--ft-loss", action="store_true", help="deepspeed mode: ft's loss (losses.py), not HF's")
    parser.add_argument("--probes", action="store_true", help="deepspeed mode: probe the worker's old statements")
    parser.add_argument("--profile", type=int, default=0, help="profile this many steps after the timed ones")
    parser.add_argument("--profile-rows", type=int, default=25)
    parser.add_argument("--lifecycle-steps", type=int, default=12)
    parser.add_argument("--lifecycle-twice", action="store_true",
                        help="lifecycle: train straight through twice, to show the device's run-to-run spread")
    args = parser.parse_args()

    import torch

    args.device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    if args.device != "cuda" and not args.tiny:
        raise SystemExit("no CUDA device: use --tiny for the CPU smoke test")
    args.shape = dict(TINY if args.tiny else LLAMA3_8B)
    if args.layers:
        args.shape["num_hidden_layers"] = args.layers
    args.seq = args.seq or (64 if args.tiny else 4096)
    if args.tiny:
        args.warmup, args.steps = min(args.warmup, 1), min(args.steps, 2)
        if args.configs == parser.get_default("configs"):
            args.configs = "mb1,gc+mb2"
    args.targets = args.targets.split(",")
    args.sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    args.worker_config = parse_config(args.worker_config)
    modes = args.modes.split(",")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32

    import deepspeed
    import peft
    import transformers

    environment = {"mode": "environment", "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                   "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
                   "peft": peft.__version__, "deepspeed": deepspeed.__version__, "shape": args.shape, "seq": args.seq,
                   "dtype": str(dtype), "lora": {"rank": args.rank, "alpha": args.alpha, "targets": args.targets},
                   "matmul_params_b": round(matmul_params(args.shape) / 1e9, 3),
                   "lora_params_m": round(lora_params(args.shape, args.rank, args.targets) / 1e6, 2),
                   "flops_per_token_g": {k: round(v / 1e9, 2) for k, v in
                                         flops_per_token(args.shape, args.seq, args.rank, args.targets).items()},
                   "warmup": args.warmup, "steps": args.steps, "time": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    report(environment)

    if "peft" in modes or "deepspeed" in modes:
        model = add_lora(build_model(args.shape, args.seq, args.device, dtype), args.rank, args.alpha, args.targets,
                         args.adapter_dtype)
        if args.device == "cuda":
            report({"mode": "attention", "flash_only_forward": flash_available(model, args.device,
                                                                                args.shape["vocab_size"], False)})
        if "peft" in modes:
            configs = sorted((parse_config(c) for c in args.configs.split(",")), key=lambda c: bool(c["compile"]))
            compiled = False
            for config in configs:
                if config["compile"] and not compiled:
                    compile_layers(model)
                    compiled = True
                run_peft(model, args, config, compiled)
            if compiled and "deepspeed" in modes:
                raise SystemExit("run the deepspeed mode in a process without compile+ configurations")
        if "deepspeed" in modes:
            run_deepspeed(model, args, parse_config(args.ds_config))
        del model
        free(args.device)
    if "worker" in modes:
        run_worker(args)
    if "lifecycle" in modes:
        run_lifecycle(args)


if __name__ == "__main__":
    main()
