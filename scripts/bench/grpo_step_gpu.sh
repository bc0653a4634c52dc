#!/usr/bin/env bash
# The GRPO-step benchmark (scripts/bench/grpo_step.py) on the lent GPU machine. TRL 1.16 and what it
# needs there travel as wheels in .whl/ (trl, datasets 5.2.0, dill, multiprocess; fetched with the
# `pip download` line of docs/benchmarks.md), Hydra/OmegaConf/math-verify in .devsite/. Usage there
# (carry .whl and .devsite):
#   bash scripts/bench/grpo_step_gpu.sh --preset embedded [options of grpo_step.py]
# Writes gpu.txt, grpo_step.md, grpo_step.json and logs.tar.gz (every worker's log and JSON) under
# $OUT (or ./grpo_step_out); the workspace (model weights) stays in /tmp.
set -euo pipefail
export OUT=${OUT:-grpo_step_out}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh" "$OUT/gpu.txt"
export TOKENIZERS_PARALLELISM=false
python3 -m pip list 2>/dev/null | grep -iE "^(torch|transformers|trl|datasets|accelerate|pyarrow|fsspec|huggingface.hub) " \
  | tee -a "$OUT/gpu.txt"
# Fail in seconds, not after the first worker, if a carried package does not import.
python3 -c "import aligner_ext.trainer.build, trl, datasets" || { echo "import check failed" | tee -a "$OUT/gpu.txt"; exit 1; }
run=${GRPO_STEP_RUN:-/tmp/grpo_step}  # another folder per call of this script in one command
status=0
python3 scripts/bench/grpo_step.py --out "$run" "$@" 2>&1 | tee "$OUT/driver.log" || status=$?
cp "$run"/grpo_step.md "$run"/grpo_step.json "$OUT"/ 2>/dev/null || true
tar -czf "$OUT/logs.tar.gz" -C "$run" --exclude=work --exclude='*.probe.pt' .
exit $status
