#!/usr/bin/env bash
# One benchmark of scripts/bench/run.py on the lent GPU machine, with the carry that
# scripts/prepare_gpu_carry.py made here (carry .whl and .devsite; docs/benchmarks.md, "Reproducing"):
#   bash scripts/bench/gpu.sh SUBCOMMAND [options of run.py SUBCOMMAND]
# Installs .whl's wheels into /tmp/site (once per machine and set of wheels), puts .devsite on the
# path, runs the subcommand with its files in /tmp/bench/NAME, and leaves in $OUT (default
# ./bench_out/gpu) NAME.json (its result.json) and NAME.tar.gz (its markdown, every worker's log and
# profile). NAME is the subcommand, or $BENCH_NAME for two runs of one subcommand in one folder.
set -uo pipefail
subcommand=$1
shift
name=${BENCH_NAME:-$subcommand}
out=$(realpath -m "${OUT:-bench_out/gpu}")
mkdir -p "$out"
if [ "$(ls .whl)" != "$(cat /tmp/site/.wheels 2>/dev/null)" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  ls .whl > /tmp/site/.wheels
fi
export PYTHONPATH=/tmp/site:$PWD/.devsite:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONWARNINGS=ignore TOKENIZERS_PARALLELISM=false
mkdir -p /tmp/bench
run=/tmp/bench/$name
python3 scripts/bench/run.py "$subcommand" "$@" --out "$run" 2>&1 | tee "$run.log"
status=${PIPESTATUS[0]}
cp "$run/result.json" "$out/$name.json" 2>/dev/null
mv "$run.log" "$run/driver.log"
tar -czf "$out/$name.tar.gz" -C "$run" --exclude=work --exclude='*.pt' --exclude='prev_*' .
exit "$status"
