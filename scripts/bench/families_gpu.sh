#!/usr/bin/env bash
# The family benchmark (scripts/bench/families.py) on one lent GPU. megatron-core, Liger-Kernel and
# the OpenAI client (the loop imports it; docs/benchmarks.md's serving-stack download line) travel as
# wheels in .whl/, Hydra/OmegaConf/math-verify in .devsite/ (carry both). Usage there:
#   bash scripts/bench/families_gpu.sh [--families a,b,...] [options of families.py]
# Writes gpu.txt, driver.log, families.md, families.json and logs.tar.gz (every family's log and
# JSON) under $OUT (or ./families_out); the checkpoints stay in /tmp.
set -euo pipefail
export OUT=${OUT:-families_out}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_env.sh" "$OUT/gpu.txt"
export TOKENIZERS_PARALLELISM=false
# Fail in seconds, not after the first family, if a carried package does not import.
python3 -c "import aligner_ext.trainer.build, torch, transformers, megatron.core; print('torch', torch.__version__, 'transformers', transformers.__version__, 'megatron-core', megatron.core.__version__)" | tee -a "$OUT/gpu.txt"
run=${FAMILIES_RUN:-/tmp/families}
status=0
python3 scripts/bench/families.py --out "$run" "$@" 2>&1 | tee "$OUT/driver.log" || status=$?
cp "$run"/families.md "$run"/families.json "$OUT"/ 2>/dev/null || true
tar -czf "$OUT/logs.tar.gz" -C "$run" --exclude=work .
exit $status
