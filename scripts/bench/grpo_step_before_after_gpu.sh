#!/usr/bin/env bash
# A library change's whole GRPO step, before and after, in one call on one GPU (scripts/bench/grpo_step.py
# --prev): each system of $SYSTEMS runs from the earlier tree $PREV (a `git archive <commit>` unpacked:
# its library and conf/, this tree's harness), then from this tree, on one workspace and one float32
# reference; this tree's side profiles the phases $PROFILE (default train,logprobs) of one more step
# (--torch-profile). The report ends with the
# ratios after / before of the step and of each phase. Usage there (carry .whl, .devsite and $PREV):
#   PREV=.prev SYSTEMS="ours_rollout ours_megatron" bash scripts/bench/grpo_step_before_after_gpu.sh --preset qwen1_5b --steps 2
# Writes grpo_step.md and grpo_logs.tar.gz (the JSON report, every worker's log and profile) under $OUT.
set -uo pipefail
out=$(realpath -m "${OUT:-grpo_before_after_out}")
mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh" "$out/gpu.txt"
export TOKENIZERS_PARALLELISM=false
systems=""
for system in ${SYSTEMS:-ours_rollout ours_megatron}; do systems="$systems,prev:$system,$system"; done
run=${GRPO_STEP_RUN:-/tmp/grpo_before_after}
python3 scripts/bench/grpo_step.py --out "$run" --prev "$PREV" --systems "${systems#,}" --variants "" --torch-profile "${PROFILE:-train,logprobs}" "$@" \
  > "$out/grpo_driver.log" 2>&1
status=$?
cp "$run"/grpo_step.md "$out"/ 2>/dev/null
tar -czf "$out/grpo_logs.tar.gz" -C "$run" --exclude=work --exclude='*.probe.pt' .
cat "$out/grpo_step.md" 2>/dev/null || tail -n 30 "$out/grpo_driver.log"
exit $status
