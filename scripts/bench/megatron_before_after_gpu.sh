#!/usr/bin/env bash
# A Megatron-backend speed change, before and after in one call on one GPU: the training bench
# (scripts/bench/megatron_bench.py, Qwen2.5-1.5B shape, TP=1, a GRPO step's ragged batch of 256
# sequences packed 16384 tokens per micro-batch; the "after" with a profile of one train call), then
# the whole GRPO step (scripts/bench/grpo_step.py, ours_megatron_16k, 3 steps after 1), each run
# from $PREV (a `git archive` of the earlier commit) and from this tree. Files under $OUT.
# Usage there (carry .whl, .devsite and .prev):  PREV=.prev bash scripts/bench/megatron_before_after_gpu.sh
set -uo pipefail
source "$(dirname "$0")/prev_tree.sh" megatron_before_after_out scripts/bench/megatron_bench.py scripts/bench/megatron_gpu.sh scripts/bench/gpu_env.sh scripts/bench/grpo_step*.py
train="tp1 --preset qwen1_5b --batch 256 --no-reference --steps 2 --set micro_batch_tokens=16384"
step=(--preset qwen1_5b --systems ours_megatron_16k --variants "" --steps 3 --warmup 1 --timeout 200)
for side in before after; do
  tree=$([ $side = before ] && echo "$PREV" || echo .)
  extra=$([ $side = after ] && echo --profile || true)
  (cd "$tree" && NPROC=1 OUT="$out/train_$side" timeout 200 bash scripts/bench/megatron_gpu.sh $train $extra >/dev/null 2>&1)
  tail -n 1 "$out/train_$side/megatron_bench.jsonl" 2>/dev/null || echo "train_$side: failed"
done
for side in before after; do
  tree=$([ $side = before ] && echo "$PREV" || echo .)
  (cd "$tree" && OUT="$out/step_$side" GRPO_STEP_RUN=/tmp/step_$side bash scripts/bench/grpo_step_gpu.sh "${step[@]}" >/dev/null 2>&1)
  grep "^| ours" "$out/step_$side/grpo_step.md" 2>/dev/null || echo "step_$side: failed"
done
