#!/usr/bin/env bash
# The second device-tool call of 2026-11-27 (GPU.md): one rank's whole ft run (NCCL path), then the
# worker's throughput timed from per-step metrics lines, with its host memory split.
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
WORK=/tmp/ftgpu; mkdir -p "$WORK"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  $(ls .whl/*.whl | grep -v liger) || exit 1
export PYTHONPATH=/tmp/site
B="python3 benchmarks/gpu_lora.py --workdir $WORK"
stage() { echo "=== $1 $(date -u +%T)"; }
stage "lifecycle: one rank's whole run, stop, resume, equal adapters (4 layers)"
timeout 150 $B --modes lifecycle --layers 4 --seq 1024 --lifecycle-steps 9 --log-lines 3
stage "ft worker, new code, defaults"
timeout 120 $B --modes worker --label new --log-lines 8
stage end
