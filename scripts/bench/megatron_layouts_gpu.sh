#!/usr/bin/env bash
# The whole training loop with the Megatron backend on the lent 2-GPU machine at DP=2 and PP=2, with
# generation and rewards split across the two ranks, and DP=2 with the split off (every rank repeats
# them), to see what the split costs or saves. The embedded demo job (conf/demo.yaml), bf16, NCCL.
# megatron-core travels as its cp312 wheel in .whl/, the pure-Python packages the machine lacks in
# .devsite/ (see megatron_gpu.sh). Usage there:
#   bash scripts/bench/megatron_layouts_gpu.sh [steps (default 20)] [extra overrides...]
# Writes metrics, summaries, logs and a table of mean stage times under $OUT (or ./megatron_layouts_out).
set -euo pipefail
out=${OUT:-megatron_layouts_out}
steps=${1:-20}
shift || true
mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh" "$out/gpu.txt"
runs=/tmp/megatron_layouts
run() {
  SECONDS=0
  torchrun --nproc_per_node=2 --master_port="$2" -m aligner_ext train --config-name demo \
    policy.backend=megatron trainer.total_steps="$steps" trainer.eval_every="$steps" trainer.progress_bar=false \
    trainer.output_dir=$runs trainer.run_name="$1" "${@:3}" > "$out/$1.log" 2>&1
  echo "$1: $SECONDS s" | tee -a "$out/times.txt"
  mkdir -p "$out/$1" && cp $runs/$1/metrics.jsonl $runs/$1/summary.json "$out/$1/"
}
run dp2_split 29551 "$@"
run dp2_repeated 29552 generator.split_across_ranks=false reward.split_across_ranks=false "$@"
run pp2_split 29553 policy.pipeline_model_parallel_size=2 "$@"
python3 - "$runs" dp2_split dp2_repeated pp2_split <<'PY' | tee "$out/stages.txt"
import json, sys
runs, names = sys.argv[1], sys.argv[2:]
keys = ["timing/rollout_s", "timing/logprobs_s", "timing/train_s", "timing/step_s"]
print("run", *keys, "val/accuracy before -> after", sep=" | ")
for name in names:
    records = [json.loads(line) for line in open(f"{runs}/{name}/metrics.jsonl")]
    steps = [r for r in records if r["step"] > 1]  # the first step includes warm-up of kernels
    means = [sum(r[k] for r in steps) / len(steps) for k in keys]
    print(name, *(f"{m:.3f}" for m in means), f"{records[0]['val/accuracy']:.3f} -> {records[-1]['val/accuracy']:.3f}",
          sep=" | ")
PY
