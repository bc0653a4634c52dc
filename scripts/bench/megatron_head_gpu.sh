#!/usr/bin/env bash
# The fused log-prob head and Liger kernels by default on the Megatron backend, before and after in
# one call on one GPU, at a GRPO step's batch (256 sequences of 128-256 prompt + 64-512 response
# tokens, packed 8192 tokens per micro-batch); one JSON line each, the runs' files under $OUT:
#   head          scripts/bench/logprob_head.py: the log-prob head alone, previous against fused
#   before        the library at $PREV (a `git archive` of the earlier commit) with its defaults
#   before_liger  the same with policy.kernels=liger
#   after         this tree with its defaults, and a profile of one train call
# Usage there (carry .whl, .devsite and .prev):  PREV=.prev bash scripts/bench/megatron_head_gpu.sh
set -uo pipefail
out=$(realpath -m "${OUT:-megatron_head_out}")
mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh" "$out/gpu.txt"
python3 scripts/bench/logprob_head.py 2>"$out/head.err" | tee "$out/head.jsonl"
common="tp1 --preset ${PRESET:-qwen1_5b} --batch ${BATCH:-256} --micro 8 --no-reference --steps 2 --set micro_batch_tokens=8192"
bench() {  # name, directory of the library, then more arguments of megatron_bench.py
  local name=$1 tree=$2
  shift 2
  (cd "$tree" && NPROC=1 OUT="$out/$name" timeout 200 bash scripts/bench/megatron_gpu.sh $common "$@" >/dev/null 2>&1)
  tail -n 1 "$out/$name/megatron_bench.jsonl" 2>/dev/null || echo "$name: failed (see $out/$name/bench.log)"
}
if [ -n "${PREV:-}" ]; then
  ln -sfn "$PWD/.whl" "$PREV/.whl"
  ln -sfn "$PWD/.devsite" "$PREV/.devsite"
  cp scripts/bench/megatron_bench.py scripts/bench/megatron_gpu.sh scripts/bench/gpu_env.sh "$PREV/scripts/bench/"
  bench before "$PREV"
  bench before_liger "$PREV" --set kernels=liger
fi
bench after . --profile
