#!/bin/bash
# Makes .whl/ (ignored, carried to a GPU machine) for benchmarks/gpu_session.sh and
# benchmarks/accelerator_device.sh: run it here, where PyPI and gguf are reachable, before a
# session's first device call (issue 47; BENCHMARKS.md, "Accelerator").
#
#   bash benchmarks/device_kit.sh   # ~15 s; prints the kit's size (the carry limit: 64 MiB)
#
# The GPU image has Python 3.12, jax 0.11.2 with the CUDA plugin, torch, transformers, optax,
# absl, safetensors and numpy, and no network. It lacks what is downloaded here, as wheels for
# Python 3.12 on manylinux x86_64: flax 0.12.12 (0.12.8 does not import under jax 0.11.2),
# orbax-checkpoint 0.12.8, ml_collections, tensorboardX, and TRL 1.16.0 with the datasets stack
# it imports. SmolLM2's tokenizer (3.4 MB) goes in .whl/smollm2_tokenizer: the GGUF (98 MB) is
# too large to carry, and accelerator.py builds a random model of the benchmark's shape.
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=${KIT:-.whl}
mkdir -p "$KIT"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 \
  -d "$KIT" flax==0.12.12 orbax-checkpoint==0.12.8 ml_collections tensorboardX trl==1.16.0 \
  datasets dill multiprocess xxhash
if [ ! -f "$KIT/smollm2_tokenizer/tokenizer.json" ]; then
  python3 benchmarks/accelerator.py --save_tokenizer="$KIT/smollm2_tokenizer"
fi
ls "$KIT"
size=$(du -sm "$KIT" | cut -f1)
echo "device_kit: $KIT holds ${size} MiB (the device tool carries at most 64 MiB)"
if [ "$size" -ge 64 ]; then
  echo "error: $KIT is over 64 MiB; remove what the run does not need" >&2
  exit 2
fi
