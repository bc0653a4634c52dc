#!/usr/bin/env bash
# scripts/bench/sliding_window.py on a lent GPU (bench_gpu.sh; carry .whl and .devsite):
#   bash scripts/bench/sliding_window_gpu.sh --families mistral,gemma3_text --window 512
exec bash "$(dirname "$0")/bench_gpu.sh" sliding_window "$@"
