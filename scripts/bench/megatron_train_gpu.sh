#!/usr/bin/env bash
# Megatron backend training speed on one GPU (TP=1), the settings one after another in one call,
# with scripts/bench/megatron_bench.py (one JSON line each under $OUT/<name>/megatron_bench.jsonl):
#   before          the library at $PREV (a `git archive` of the earlier commit), when PREV is set
#   rows            padded rows of --micro sequences, plain modules          (policy.kernels=none)
#   rows_liger      padded rows, Liger's RMSNorm + megatron-core's fused SwiGLU (policy.kernels=liger)
#   packed_liger    sequences packed under a token budget                     (+ micro_batch_tokens)
#   packed_recompute  the same with activation recomputation                  (+ recompute_activations)
#   3b_distopt      Qwen2.5-3B's shape, packed, Liger, recomputation, distributed optimizer (tp1_distopt)
# packed_liger also writes a profile of one train call. Usage there (carry .whl and .devsite):
#   [PREV=.prev] bash scripts/bench/megatron_train_gpu.sh [preset] [token budget]
set -uo pipefail
out=$(realpath -m "${OUT:-megatron_train_out}")
mkdir -p "$out"
preset=${1:-qwen1_5b}
budget=${2:-8192}
common="--preset $preset --micro 8 --no-reference"
bench() {  # name, then the arguments of megatron_bench.py
  local name=$1
  shift
  NPROC=1 OUT="$out/$name" timeout 180 bash scripts/bench/megatron_gpu.sh "$@" >/dev/null 2>&1
  tail -n 1 "$out/$name/megatron_bench.jsonl" 2>/dev/null || echo "$name: failed (see $out/$name/bench.log)"
}
if [ -n "${PREV:-}" ]; then
  ln -sfn "$PWD/.whl" "$PREV/.whl"
  ln -sfn "$PWD/.devsite" "$PREV/.devsite"
  cp scripts/bench/megatron_bench.py scripts/bench/megatron_gpu.sh "$PREV/scripts/bench/"
  (cd "$PREV" && bench before tp1 $common)
fi
bench rows tp1 $common --set kernels=none
bench rows_liger tp1 $common --set kernels=liger
bench packed_liger tp1 $common --set kernels=liger --set micro_batch_tokens=$budget --profile
bench packed_recompute tp1 $common --set kernels=liger --set micro_batch_tokens=$budget --set recompute_activations=true
bench 3b_distopt tp1_distopt --preset qwen3b --micro 8 --no-reference --set kernels=liger --set micro_batch_tokens=$budget \
  --set recompute_activations=true
