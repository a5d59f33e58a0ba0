#!/usr/bin/env bash
# One device-tool call (benchmarks/GPU.md, 2026-11-27): the bare loop and ft's worker on the same
# GPU in the same run, today's worker (commit ac24b55, unpacked into .bench_old) beside the new,
# profiles of one ft step against one bare step, and one rank's whole ft run (NCCL path).
# Needs .whl/ (deepspeed and pydantic wheels; liger-kernel kept apart) and .bench_old/ carried.
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/ft-gpu-out}; mkdir -p "$OUT"
WORK=/tmp/ftgpu; mkdir -p "$WORK"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  $(ls .whl/*.whl | grep -v liger) || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/liger .whl/liger*.whl || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
B="python3 benchmarks/gpu_lora.py --workdir $WORK"
stage() { echo "=== $1 $(date -u +%T)"; }
stage "bare loop, eager and compiled"
timeout 110 $B --modes peft --configs mb1,compile+mb1 --profile 2 --profile-rows 12
stage "ft worker, new code, defaults"
timeout 130 $B --modes worker --label new --log-lines 14
stage "ft worker, today's code (ac24b55)"
timeout 75 $B --modes worker --worker-repo .bench_old --label old --log-lines 5
stage "deepspeed in-process: today's engine config, HF loss, eager"
timeout 50 $B --modes deepspeed --ds-extra '{"bf16": {"enabled": true}}' --label ds-before --profile 2 --profile-rows 12
stage "deepspeed in-process: ft's engine config and loss, compiled"
timeout 60 $B --modes deepspeed --ds-config compile+mb1 --ft-loss --label ds-after --profile 2 --profile-rows 12
stage "lifecycle: one rank's whole run, stop, resume, equal adapters (4 layers)"
timeout 110 $B --modes lifecycle --layers 4 --seq 2048 --log-lines 4
stage "with Liger where installed: deepspeed in-process, compiled, ft's loss"
PYTHONPATH=/tmp/site:/tmp/liger timeout 50 $B --modes deepspeed --ds-config compile+mb1 --ft-loss --label ds-liger
stage end
