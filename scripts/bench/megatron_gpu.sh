#!/usr/bin/env bash
# Megatron backend on a lent GPU machine: log-prob agreement with HF (bf16) and GRPO training-step
# throughput / MFU / memory (scripts/bench/megatron_bench.py): on 2 GPUs for TP=2, TP=2 + sequence
# parallel, DP=2 and DP=2 + distributed optimizer; on one GPU (NPROC=1) for tp1 and tp1_distopt. megatron-core travels as its cp312 wheel in .whl/, the
# pure-Python packages the machine lacks in .devsite/ (see gpu_smoke.sh). Usage there:
#   [NPROC=1] bash scripts/bench/megatron_gpu.sh [layouts and options of megatron_bench.py]
# Writes megatron_bench.jsonl and the log under $OUT (or ./megatron_bench_out).
set -euo pipefail
out=${OUT:-megatron_bench_out}
mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh" "$out/gpu.txt"
python3 -c "import torch, transformers, megatron.core; print('torch', torch.__version__, 'transformers', transformers.__version__, 'megatron-core', megatron.core.__version__)" | tee -a "$out/gpu.txt"
args=${*:-tp2 tp2_sp dp2 dp2_distopt}
torchrun --nproc_per_node=${NPROC:-2} --master_port=29533 scripts/bench/megatron_bench.py $args --out "$out/megatron_bench.jsonl" 2>&1 | tee -a "$out/bench.log"
