#!/usr/bin/env bash
# The Megatron GPU checks of docs/megatron.md in one call on the lent 2-GPU machine (device time is
# scarce: one machine start for all of them). Correctness runs share the GPUs; timed runs run alone:
#   1. megatron_variants_gpu.sh (every variant through the loop at TP=2 and DP=2)  } at the same time
#      and megatron_ckpt_gpu.sh (distributed checkpoints resumed at another layout) } (timings of 1 perturbed)
#   2. refit_bench.py on the 0.5B Qwen2-shape model (TP=2, PP=2, DP=2), alone
#   3. generation_engines_gpu.sh (HF engine vs megatron-core's legacy static engine, one GPU), alone
# Usage there (carry .whl and .devsite):
#   VARIANTS="mtpo graded_prompt" bash scripts/bench/megatron_all_gpu.sh [variant steps] [warm-up steps] [ckpt steps]
# Everything lands in $OUT/megatron_all.tgz (the device returns few files), plus summary.txt.
set -uo pipefail
out=${OUT:-megatron_all_out}
work=/tmp/megatron_all
mkdir -p "$out" "$work"
source "$(dirname "$0")/gpu_env.sh" "$out/gpu.txt"
OUT=$work/variants timeout 300 bash scripts/bench/megatron_variants_gpu.sh "${1:-4}" "${2:-200}" > $work/variants.txt 2>&1 &
sleep 20  # both scripts reinstall into /tmp/site (gpu_env.sh): let the first finish
OUT=$work/ckpt timeout 300 bash scripts/bench/megatron_ckpt_gpu.sh "${3:-6}" > $work/ckpt.txt 2>&1 &
wait
timeout 70 torchrun --nproc_per_node=2 --master_port=29650 scripts/bench/refit_bench.py --model qwen2-0.5b-shape \
  --repeats 5 tp2 pp2 dp2 > $work/refit.txt 2>&1
OUT=$work/engines timeout 120 bash scripts/bench/generation_engines_gpu.sh > $work/engines.txt 2>&1
{
  cat $work/variants/variants.md 2>/dev/null || tail -5 $work/variants.txt
  cat $work/ckpt/ckpt_check.txt 2>/dev/null || tail -5 $work/ckpt.txt
  grep -v "^W\|^\[" $work/refit.txt | tail -12
  grep -i "pass\|fail\|tok" $work/engines.txt | tail -20
} > "$out/summary.txt"
tar czf "$out/megatron_all.tgz" -C "$work" .
cat "$out/summary.txt"
