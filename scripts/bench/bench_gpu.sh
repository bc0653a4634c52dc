#!/usr/bin/env bash
# One benchmark script of this folder on a lent GPU, its files brought back in two: NAME.py runs with
# --out /tmp/NAME and the given options; $OUT gets NAME.md, NAME.tar.gz (everything it wrote: JSON,
# each worker's log and profile) and NAME_driver.log. For the scripts that write NAME.md:
# megatron_families, sliding_window. Usage there (carry .whl and .devsite, and an earlier tree for --prev):
#   bash scripts/bench/bench_gpu.sh megatron_families --families llama3,gemma3_text,olmo2 --profile [--prev .prev]
#   bash scripts/bench/bench_gpu.sh sliding_window --families mistral,gemma3_text --window 512
set -uo pipefail
name=$1
shift
out=$(realpath -m "${OUT:-${name}_out}")
mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh" "$out/gpu.txt"
run=/tmp/$name
python3 "scripts/bench/$name.py" --out "$run" "$@" > "$out/${name}_driver.log" 2>&1
status=$?
cp "$run/$name.md" "$out"/ 2>/dev/null
tar -czf "$out/$name.tar.gz" -C "$run" .
head -n 40 "$out/$name.md" 2>/dev/null || tail -n 30 "$out/${name}_driver.log"
exit $status
