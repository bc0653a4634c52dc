#!/usr/bin/env bash
# The Megatron GPU checks of docs/megatron.md on the lent 2-GPU machine, with one set-up. Correctness
# runs share the GPUs; timed runs run alone:
#   variants+ckpt  megatron_variants_gpu.sh (every variant through the loop at TP=2 and DP=2) and
#                  megatron_ckpt_gpu.sh (distributed checkpoints resumed at another layout) at the
#                  same time (the variants' timings are then perturbed); about 5 minutes
#   refit          refit_bench.py on the 0.5B Qwen2-shape model (TP=2, PP=2, DP=2), alone; 133 s on
#                  2x H200, mostly building the model three times
#   engines        generation_engines_gpu.sh (HF engine vs megatron-core's legacy static engine, one
#                  GPU), alone; 115 s on one H200
# All three take more than one 10-minute device call: choose with PARTS (default: all of them).
# Usage there (carry .whl and .devsite):
#   PARTS="refit engines" bash scripts/bench/megatron_all_gpu.sh
#   VARIANTS="mtpo graded_prompt" PARTS=variants+ckpt bash scripts/bench/megatron_all_gpu.sh [variant steps] [warm-up steps] [ckpt steps]
# Everything lands in $OUT/megatron_all.tgz (the device returns few files), plus summary.txt.
set -uo pipefail
out=${OUT:-megatron_all_out}
work=/tmp/megatron_all
parts=" ${PARTS:-variants+ckpt refit engines} "
mkdir -p "$out" "$work"
source "$(dirname "$0")/gpu_env.sh" "$out/gpu.txt"
if [[ $parts == *" variants+ckpt "* ]]; then
  OUT=$work/variants timeout 300 bash scripts/bench/megatron_variants_gpu.sh "${1:-4}" "${2:-200}" > $work/variants.txt 2>&1 &
  sleep 20  # both scripts reinstall into /tmp/site (gpu_env.sh): let the first finish
  OUT=$work/ckpt timeout 300 bash scripts/bench/megatron_ckpt_gpu.sh "${3:-6}" > $work/ckpt.txt 2>&1 &
  wait
fi
if [[ $parts == *" refit "* ]]; then
  timeout 200 torchrun --nproc_per_node=2 --master_port=29650 scripts/bench/refit_bench.py --model qwen2-0.5b-shape \
    --repeats 5 tp2 pp2 dp2 > $work/refit.txt 2>&1
fi
if [[ $parts == *" engines "* ]]; then
  OUT=$work/engines timeout 300 bash scripts/bench/generation_engines_gpu.sh > $work/engines.txt 2>&1
fi
{
  cat $work/variants/variants.md 2>/dev/null || tail -5 $work/variants.txt 2>/dev/null
  cat $work/ckpt/ckpt_check.txt 2>/dev/null || tail -5 $work/ckpt.txt 2>/dev/null
  grep -v "^W\|^\[" $work/refit.txt 2>/dev/null | tail -12
  grep -i "pass\|fail\|result\|tok/s" $work/engines.txt 2>/dev/null | tail -20
} > "$out/summary.txt"
tar czf "$out/megatron_all.tgz" -C "$work" .
cat "$out/summary.txt"
