#!/usr/bin/env bash
# One device-tool call for benchmarks/GPU.md: the bare loop and ft's worker on the same GPU in the
# same run, a profile of one ft step beside the bare one, one rank's whole ft run (NCCL path) with
# the GPU's own run-to-run spread, today's worker (an older commit unpacked into .bench_old) beside
# the new, and the loop-overhead commands of TRAINING.md.
#   carry: .whl (deepspeed, hjson, pydantic, pydantic_core, annotated-types, typing-inspection,
#   typing_extensions wheels; liger-kernel optional, kept apart) and .bench_old
#   run:   bash benchmarks/gpu_session.sh 2>&1 | tee $OUT/log.txt      (about 9 minutes on an H200)
set -o pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
WORK=/tmp/ftgpu; mkdir -p "$WORK"
wheels=()
for wheel in .whl/*.whl; do
  case "$wheel" in *liger*) ;; *) wheels+=("$wheel") ;; esac
done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "${wheels[@]}" || exit 1
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
B=(python3 benchmarks/gpu_lora.py --workdir "$WORK")
stage() { echo "=== $1 $(date -u +%T)"; }
stage "bare loop, eager and compiled (the baseline)"
timeout 110 "${B[@]}" --modes peft --configs mb1,compile+mb1 --profile 2 --profile-rows 12
stage "ft worker, defaults"
timeout 120 "${B[@]}" --modes worker --label new --log-lines 8
stage "deepspeed in-process as ft runs it (ZeRO-1, compiled, ft's loss), profiled"
timeout 60 "${B[@]}" --modes deepspeed --ds-config compile+mb1 --ft-loss --label ft-step --profile 2 --profile-rows 12
stage "one rank's whole run twice straight, once stopped and resumed (4 layers)"
timeout 170 "${B[@]}" --modes lifecycle --layers 4 --seq 1024 --lifecycle-steps 9 --lifecycle-twice --log-lines 3
if [ -d .bench_old ]; then
  stage "ft worker, older code (.bench_old)"
  timeout 75 "${B[@]}" --modes worker --worker-repo .bench_old --label old --zero-stage 2 --log-lines 4
fi
stage "TRAINING.md: the loop's overhead on a GPU"
timeout 60 python3 benchmarks/loop_overhead.py --device cuda --hidden 2048 --layers 8 --block 50
timeout 120 python3 benchmarks/training.py --device cuda --hidden 2048 --layers 8 --control
stage end
