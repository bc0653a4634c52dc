#!/usr/bin/env bash
# Every variant through the whole training loop with the Megatron backend on the lent 2-GPU machine:
# the embedded demo job (conf/demo.yaml) as plain GRPO and with +variant=dapo, cpo, mtpo and
# graded_prompt, each at TP=2 and at DP=2 (bf16, NCCL), a few steps each. mtpo and graded_prompt
# train on their own built-in tasks; their embedded-model warm-up (mtpo's is 400 steps) is cut to
# the second argument so the ten runs fit in about 8 minutes. megatron-core travels as its cp312
# wheel in .whl/ with psutil (the distributed checkpoint writer needs it), the pure-Python
# packages the machine lacks in .devsite/ (see megatron_gpu.sh). Usage there:
#   bash scripts/bench/megatron_variants_gpu.sh [steps (default 8)] [warm-up steps (default 200)] [extra overrides...]
#   VARIANTS="grpo dapo" LAYOUTS=tp2 bash scripts/bench/megatron_variants_gpu.sh   (a subset)
#   PARALLEL=5 bash scripts/bench/megatron_variants_gpu.sh ...   (up to 5 runs at once on the same two
#   GPUs: for larger models, whose runs are dominated by start-up and warm-up; step times then
#   include the other runs' load and only show that the runs work)
#   RUN_TIMEOUT=240 ...   (each run stopped after that many seconds, exit status 124 in the table)
# Writes under $OUT (or ./megatron_variants_out): variants.md (one row per run: exit status, steps
# done, steps with a gradient (0 when every group's rewards agreed at every step), mean step time and response tokens/s after the first step (metrics.jsonl timing/*), held-out
# greedy accuracy and mean reward before -> after, wall time), variants.jsonl, and per run its log,
# metrics.jsonl and summary.json.
set -uo pipefail  # not -e: a failing run is recorded in the table and the next one starts
out=${OUT:-megatron_variants_out}
steps=${1:-8}
warmup=${2:-200}
shift 2 || shift $#
mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh" "$out/gpu.txt"
runs=/tmp/megatron_variants
rm -rf "$runs"
: > "$out/exits.jsonl"
declare -A variant=(
  [grpo]=""
  [dapo]="+variant=dapo"
  [cpo]="+variant=cpo"
  [mtpo]="+variant=mtpo model.warmup.steps=$warmup"
  [graded_prompt]="+variant=graded_prompt model.warmup.steps=$warmup"
)
declare -A layout=(
  [tp2]="policy.tensor_model_parallel_size=2"
  [dp2]="policy.tensor_model_parallel_size=1"
)
port=29551
# One run: its log, exit status and wall time, its metrics copied under $out.
run_one() {
  local run=$1 port=$2 start=$SECONDS status
  shift 2
  # Every run's rank 0 warms the embedded model up: runs alternate which GPU holds their rank 0.
  CUDA_VISIBLE_DEVICES=$([ $((port % 2)) = 0 ] && echo 0,1 || echo 1,0) timeout "${RUN_TIMEOUT:-0}" torchrun --nproc_per_node=2 --master_port="$port" -m aligner_ext train --config-name demo "$@" \
    > "$out/$run.log" 2>&1
  status=$?
  echo "{\"run\": \"$run\", \"exit_status\": $status, \"wall_s\": $((SECONDS - start))}" >> "$out/exits.jsonl"
  echo "$run: exit $status, $((SECONDS - start)) s"
  mkdir -p "$out/$run"
  cp $runs/$run/metrics.jsonl $runs/$run/summary.json "$out/$run/" 2>/dev/null
}
for name in ${VARIANTS:-grpo dapo cpo mtpo graded_prompt}; do
  for par in ${LAYOUTS:-tp2 dp2}; do
    while [ "$(jobs -rp | wc -l)" -ge "${PARALLEL:-1}" ]; do wait -n; done
    run=${name}_$par
    # shellcheck disable=SC2086  # the override lists split on spaces
    run_one "$run" $port ${variant[$name]} policy.backend=megatron ${layout[$par]} trainer.total_steps="$steps" \
      trainer.save_every=0 trainer.eval_every=0 trainer.progress_bar=false trainer.output_dir=$runs \
      trainer.run_name=$run "$@" &
    port=$((port + 1))
  done
done
wait
python3 - "$out" "$steps" <<'PY' | tee "$out/variants.md"
import json, sys
from pathlib import Path

out, steps = Path(sys.argv[1]), int(sys.argv[2])


def mean(values):
    return sum(values) / len(values) if values else None


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


print(f"| run | exit | steps done / {steps} | steps with a gradient | mean step s | tokens/s | held-out accuracy | "
      "held-out reward | wall s |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
rows = []
for line in (out / "exits.jsonl").read_text().splitlines():
    row = json.loads(line)
    path = out / row["run"] / "metrics.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    trained = [r for r in records if "timing/step_s" in r]
    timed = trained[1:] or trained  # the first step includes one-off start-up work
    row["steps_done"] = len(trained)
    row["steps_with_gradient"] = sum(r.get("actor/grad_norm", 0) > 0 for r in trained)  # 0: every advantage was 0
    row["mean_step_s"] = mean([r["timing/step_s"] for r in timed])
    row["tokens_per_s"] = mean([r["timing/tokens_per_s"] for r in timed])
    for key in ("accuracy", "reward_mean"):
        evals = [r[f"val/{key}"] for r in records if f"val/{key}" in r]
        row[f"{key}_before"], row[f"{key}_after"] = (evals[0], evals[-1]) if len(evals) > 1 else (None, None)
    rows.append(row)
    print(f"| {row['run']} | {row['exit_status']} | {row['steps_done']} | {row['steps_with_gradient']} | "
          f"{fmt(row['mean_step_s'], '.3f')} | "
          f"{fmt(row['tokens_per_s'], '.0f')} | {fmt(row['accuracy_before'], '.1%')} -> {fmt(row['accuracy_after'], '.1%')} | "
          f"{fmt(row['reward_mean_before'], '.3f')} -> {fmt(row['reward_mean_after'], '.3f')} | {row['wall_s']} |")
(out / "variants.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
PY
