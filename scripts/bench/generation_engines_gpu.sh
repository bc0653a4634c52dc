#!/usr/bin/env bash
# Generation speed on one GPU: the HF engine against megatron-core's legacy static inference engine
# on the same Qwen2.5-0.5B-shape weights (scripts/bench/generation_engines.py). megatron-core travels
# as its cp312 wheel in .whl/, the pure-Python packages the machine lacks in .devsite/ (see
# gpu_smoke.sh). Usage there (carry .whl and .devsite):
#   bash scripts/bench/generation_engines_gpu.sh [options of generation_engines.py]
# Writes generation_engines.json and the log under $OUT (or ./generation_engines_out).
set -euo pipefail
export OUT=${OUT:-generation_engines_out}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh" "$OUT/gpu.txt"
python3 -c "import torch, transformers, megatron.core; print('torch', torch.__version__, 'transformers', transformers.__version__, 'megatron-core', megatron.core.__version__)" | tee -a "$OUT/gpu.txt"
torchrun --nproc_per_node=1 --master_port=29561 scripts/bench/generation_engines.py "$@" 2>&1 | tee "$OUT/generation_engines.log"
