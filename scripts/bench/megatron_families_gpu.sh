#!/usr/bin/env bash
# scripts/bench/megatron_families.py on a lent GPU (bench_gpu.sh; carry .whl, .devsite and any --prev tree):
#   bash scripts/bench/megatron_families_gpu.sh --families llama3,gemma3_text,olmo2 --warmup 2 --steps 6 --profile [--prev .prev]
exec bash "$(dirname "$0")/bench_gpu.sh" megatron_families "$@"
