#!/usr/bin/env bash
# Generation through `aligner-ext serve` and the weight push modes on the lent GPU machine
# (scripts/bench/serving.py), for each preset given:
#   bash scripts/bench/serving_gpu.sh "embedded qwen1_5b" [options of serving.py]
# Carry .whl (with fastapi, uvicorn, starlette, pydantic, pydantic-core, openai, httpx2 and their
# small dependencies: the `pip download` line in docs/benchmarks.md) and .devsite (gpu_env.sh).
# Writes gpu.txt and, per preset, serving_<preset>.md, .json and .log under $OUT (or ./serving_out).
set -uo pipefail
export OUT=${OUT:-serving_out}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh" "$OUT/gpu.txt"
presets=$1
shift
status=0
for preset in $presets; do
  python3 scripts/bench/serving.py --preset "$preset" --out "/tmp/serving_$preset" "$@" 2>&1 \
    | tee "$OUT/serving_$preset.log" || status=1
  cp "/tmp/serving_$preset/serving.md" "$OUT/serving_$preset.md" 2>/dev/null
  cp "/tmp/serving_$preset/serving.json" "$OUT/serving_$preset.json" 2>/dev/null
done
exit $status
