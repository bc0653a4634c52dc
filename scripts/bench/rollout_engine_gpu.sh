#!/usr/bin/env bash
# Generation alone on the lent GPU machine (scripts/bench/rollout_engine.py), for each preset given:
#   bash scripts/bench/rollout_engine_gpu.sh "embedded qwen1_5b" [options of rollout_engine.py]
# Carry .whl and .devsite (gpu_env.sh). Writes gpu.txt and, per preset, rollout_engine_<preset>.md,
# .json and .log under $OUT (or ./rollout_engine_out).
set -uo pipefail
export OUT=${OUT:-rollout_engine_out}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh" "$OUT/gpu.txt"
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
presets=$1
shift
status=0
for preset in $presets; do
  python3 scripts/bench/rollout_engine.py --preset "$preset" --out "/tmp/rollout_engine_$preset" "$@" 2>&1 \
    | tee "$OUT/rollout_engine_$preset.log" || status=1
  cp "/tmp/rollout_engine_$preset/rollout_engine.md" "$OUT/rollout_engine_$preset.md" 2>/dev/null
  cp "/tmp/rollout_engine_$preset/rollout_engine.json" "$OUT/rollout_engine_$preset.json" 2>/dev/null
done
exit $status
