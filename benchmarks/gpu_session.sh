#!/bin/bash
# Issue 47's open GPU checks as one device command (under the device tool's 10 minutes):
#
#   bash benchmarks/device_kit.sh                        # here, first: makes .whl/
#   run(command="bash benchmarks/gpu_session.sh", carry=[".whl"], kind="nvidia-h200", timeout_s=590)
#
# 1. benchmarks/cudnn_check.py: where cuDNN's fused attention leaves the float32 einsum, case by
#    case (its docstring lists the cases) -> $OUT/cudnn_check.json.
# 2. benchmarks/attention_kernels.py: one layer's attention (fwd + bwd) at the learner's shape by
#    each kernel (einsum, flash, xla, cudnn, jax's Pallas Triton FlashAttention): time and error.
# 3. tests/test_attention_gpu.py: 'cudnn' on the model-family fixtures against the float32 einsum
#    (model.attention='auto' may pick cuDNN only once this passes: attention.CUDNN_FAILED).
# 4. benchmarks/accelerator_device.sh: GRPO at the 0.4B shape, jaxrl_ga's defaults and TRL's
#    GRPOTrainer (OURS / STEPS / TRL_STEPS override) -> $OUT/accelerator.json, accelerator.txt.
# Each part has its own time limit, so that a hang in one leaves the others their time; $OUT/
# session.txt has every part's exit status; the limits sum to 580 s. On a CPU the script runs
# too (1 on XLA's attention; with GPU_SESSION_TINY=1, 2 and 4 at tiny shapes, Pallas
# interpreted; 3 skipped). Arguments go to accelerator.py (e.g. --trl=false without torch).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
source benchmarks/device_env.sh  # the kit's wheels on PYTHONPATH
part() {  # part NAME SECONDS COMMAND...: run one part, log it, record its exit status
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date -u +%H:%M:%S), limit ${limit} s): $*" | tee -a "$OUT/session.txt"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -25 "$OUT/$name.log"
  echo "== $name: exit status $rc" | tee -a "$OUT/session.txt"
}
if python3 -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
  impl=cudnn
else
  impl=xla
fi
part cudnn_check 90 python3 benchmarks/cudnn_check.py --implementation=$impl \
  --out="$OUT/cudnn_check.json"
part attention_kernels 90 python3 benchmarks/attention_kernels.py \
  --out="$OUT/attention_kernels.json" ${GPU_SESSION_TINY:+--tiny}
part attention_gpu 120 python3 -m pytest -q -s --noconftest -p no:cacheprovider \
  tests/test_attention_gpu.py
tiny=()
if [ -n "${GPU_SESSION_TINY:-}" ]; then tiny=(--tiny); fi
part accelerator 280 env OUT="$OUT/accelerator" OURS="${OURS:-defaults}" STEPS="${STEPS:-3}" \
  TRL_STEPS="${TRL_STEPS:-2}" TOTAL_TIMEOUT="${ACCELERATOR_TIMEOUT:-270}" \
  SIDE_TIMEOUT="${SIDE_TIMEOUT:-170}" bash benchmarks/accelerator_device.sh "${tiny[@]}" "$@"
cat "$OUT/session.txt"
