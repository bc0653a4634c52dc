#!/usr/bin/env bash
# A rollout-engine speed change, before and after in one call on one GPU: generation alone
# (scripts/bench/rollout_engine.py, this tree's harness on both sides) for each preset of $PRESETS,
# from $PREV (a `git archive` of the earlier commit) with engines $BEFORE, then from this tree with
# engines $AFTER and a profile of its default engine. Files under $OUT.
# Usage there (carry .whl, .devsite and .prev; $REPEATS timed calls per side, default 2):
#   PREV=.prev PRESETS="embedded qwen1_5b" BEFORE=compiled AFTER=compiled bash scripts/bench/rollout_before_after_gpu.sh
set -uo pipefail
source "$(dirname "$0")/prev_tree.sh" rollout_before_after_out scripts/bench/rollout_engine.py scripts/bench/rollout_engine_gpu.sh scripts/bench/gpu_env.sh scripts/bench/grpo_step*.py
for preset in ${PRESETS:-embedded qwen1_5b}; do
  (cd "$PREV" && OUT="$out/before" bash scripts/bench/rollout_engine_gpu.sh "$preset" --engines "${BEFORE:-compiled}" \
    --repeats "${REPEATS:-2}" --no-checks >/dev/null 2>&1)
  grep "^RESULT" "$out/before/rollout_engine_$preset.log" | sed "s/^/before $preset /" || echo "before $preset: failed"
  checks=$([ "$preset" = embedded ] || echo --no-checks)
  OUT="$out/after" bash scripts/bench/rollout_engine_gpu.sh "$preset" --engines "${AFTER:-compiled}" --repeats "${REPEATS:-2}" \
    --profile --profile-tokens 64 $checks >/dev/null 2>&1
  grep -E "^RESULT|^PASS|^FAIL" "$out/after/rollout_engine_$preset.log" | sed "s/^/after $preset /" || echo "after $preset: failed"
done
