#!/bin/bash
# benchmarks/accelerator.py on a GPU machine without network (issue 47; ../BENCHMARKS.md,
# "Accelerator"): jaxrl_ga's defaults, its tuned settings and TRL's GRPOTrainer at the 0.4B shape.
#
# Needs, in the working tree (ignored paths, carried to the machine; benchmarks/device_kit.sh
# makes both, and benchmarks/gpu_session.sh runs this script after issue 47's attention checks):
#   .whl/*.whl               the packages the machine lacks (flax 0.12.12, orbax-checkpoint
#                            0.12.8, ml_collections, tensorboardX, trl 1.16.0, datasets, dill,
#                            multiprocess, xxhash), downloaded for Python 3.12 manylinux x86_64
#   .whl/smollm2_tokenizer/  SmolLM2's tokenizer (python benchmarks/accelerator.py
#                            --save_tokenizer=.whl/smollm2_tokenizer, where gguf is installed)
# Writes $OUT/accelerator.json, $OUT/accelerator.txt (the table) and $OUT/logs/ (each side's log).
# Extra arguments go to accelerator.py (e.g. --ours=tuned --trl_steps=3).
#
#   OUT=/tmp/out bash benchmarks/accelerator_device.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/accelerator_out}
mkdir -p "$OUT/logs"
source benchmarks/device_env.sh  # the kit's wheels on PYTHONPATH
python3 - <<'EOF' 2>&1 | tee "$OUT/versions.txt"
import importlib.metadata as md
for p in ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'torch', 'transformers', 'trl',
          'datasets', 'accelerate', 'numpy'):
  try:
    print(p, md.version(p))
  except md.PackageNotFoundError:
    print(p, 'MISSING')
import jax, trl, datasets, jaxrl_ga.api  # the imports both sides need
print('devices', jax.devices())
EOF
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$OUT/versions.txt"
# Each side gets --timeout_s; the whole run stays under the device tool's 10 minutes per command.
timeout "${TOTAL_TIMEOUT:-580}" python3 benchmarks/accelerator.py \
  --tokenizer=.whl/smollm2_tokenizer --steps="${STEPS:-5}" --trl_steps="${TRL_STEPS:-4}" \
  --ours="${OURS:-tuned,defaults}" --timeout_s="${SIDE_TIMEOUT:-200}" --logs="$OUT/logs" --out="$OUT/accelerator.json" "$@" \
  2>&1 | tee "$OUT/accelerator.txt"
echo "exit status ${PIPESTATUS[0]}"
