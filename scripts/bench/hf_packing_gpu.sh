#!/usr/bin/env bash
# Packed micro-batches on the HF backend against padded rows, one call on one GPU, at a GRPO step's
# batch (256 sequences of 128-256 prompt + 64-512 response tokens: 123k real tokens in 197k padded
# positions), with scripts/bench/megatron_bench.py --backend hf; one JSON line each, files under $OUT:
#   rows_16, rows_32  policy.micro_batch_size=16 / 32 padded rows (64, the default, ran out of memory here)
#   packed_8192   policy.micro_batch_tokens=8192
#   packed_16384  policy.micro_batch_tokens=16384, with a profile of one train call
# Usage there (carry .whl and .devsite):  bash scripts/bench/hf_packing_gpu.sh [preset]
set -uo pipefail
out=$(realpath -m "${OUT:-hf_packing_out}")
mkdir -p "$out"
common="tp1 --preset ${1:-qwen1_5b} --batch 256 --no-reference --steps 2"
bench() {  # name, then more arguments of megatron_bench.py
  local name=$1
  shift
  NPROC=1 OUT="$out/$name" timeout 200 bash scripts/bench/megatron_gpu.sh $common "$@" >/dev/null 2>&1
  tail -n 1 "$out/$name/megatron_bench.jsonl" 2>/dev/null || echo "$name: failed (see $out/$name/bench.log)"
}
bench rows_16 --backend hf --micro 16
bench rows_32 --backend hf --micro 32
bench packed_8192 --backend hf --set micro_batch_tokens=8192
bench packed_16384 --backend hf --set micro_batch_tokens=16384 --profile
