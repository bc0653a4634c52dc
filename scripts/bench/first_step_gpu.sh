#!/usr/bin/env bash
# The first GRPO step on cold compile caches: one GRPO-step benchmark run per system of $SYSTEMS (in
# that order, each on its own empty Inductor and Triton caches); a system written prev:NAME runs from
# $PREV (a `git archive` of an earlier commit) with that tree's own scripts. Options go to
# grpo_step.py (--profile-first-step: where the first step's time went, by cProfile).
# Usage there (carry .whl and .devsite, and .prev for prev: systems):
#   PREV=.prev SYSTEMS="prev:ours_rollout ours_rollout" bash scripts/bench/first_step_gpu.sh --preset qwen1_5b --steps 2
# Each run's files under $OUT/<index>_<system>/ (grpo_step_gpu.sh's); a line per run: startup, first
# step, steady step, and when the first step ended.
set -uo pipefail
out=$(realpath -m "${OUT:-first_step_out}")
index=0
for entry in ${SYSTEMS:-ours_rollout}; do
  index=$((index + 1))
  system=${entry#prev:}
  tree=$PWD
  if [ "$system" != "$entry" ]; then
    tree=$(realpath "$PREV")
    ln -sfn "$PWD/.whl" "$tree/.whl"
    ln -sfn "$PWD/.devsite" "$tree/.devsite"
  fi
  caches=/tmp/first_step_caches_$index
  rm -rf "$caches" /tmp/torchinductor_* ~/.triton ~/.nv/ComputeCache
  run=/tmp/first_step_$index
  (cd "$tree" && TORCHINDUCTOR_CACHE_DIR=$caches/inductor TRITON_CACHE_DIR=$caches/triton GRPO_STEP_RUN=$run \
    OUT="$out/${index}_$system" bash scripts/bench/grpo_step_gpu.sh --systems "$system" --variants "" \
    --warmup 1 "$@" >/dev/null 2>&1)
  python3 - "$out/${index}_$system/grpo_step.json" "$system" "$entry" <<'EOF' || echo "$entry: failed"
import json, sys
result = json.load(open(sys.argv[1]))["systems"][sys.argv[2]]
print(f"{sys.argv[3]}: startup {result['startup_s']:.1f} s, first step {result['first_step_s']:.1f} s "
      f"(generation {result['first_step_phases_s']['generation']:.1f}, train {result['first_step_phases_s']['train']:.1f}),"
      f" done at {result['first_step_done_at_s']:.1f} s; steady step {result['step_s'][0]:.2f} s")
EOF
done
