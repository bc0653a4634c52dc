#!/usr/bin/env bash
# Megatron distributed checkpoints on the lent 2-GPU machine: save at one layout, resume at another
# (models/megatron/dist_checkpoint.py; the CPU tests cannot run the distributed optimizer or bf16).
# Two cases, each with the embedded demo job (conf/demo.yaml, bf16) under torchrun:
#   distopt: TP=2 with policy.use_distributed_optimizer=true  ->  DP=2 (TP=1), distributed optimizer
#   bf16:    TP=2, plain optimizer (float32 master weights)  ->  PP=2
# Per case: run `a` trains STEPS steps (checkpoint at STEPS/2); run `r` resumes a copy of it from
# STEPS/2 at the new layout with nothing left to train, so it loads and re-saves step STEPS/2: every
# tensor of that checkpoint (weights, Adam moments, float32 master weights, in megatron-core's global
# layout) must equal `a`'s bit for bit (PASS/FAIL); run `c` resumes another copy at the new layout
# and trains to STEPS (PASS: it finishes with every step logged; its first resumed step samples the
# same rollouts as `a`, whose reward is printed for comparison).
# megatron-core and psutil (its checkpoint writer needs it) travel as wheels in .whl/, the
# pure-Python packages the machine lacks in .devsite/ (see megatron_gpu.sh). Usage there:
#   [CASES="distopt bf16"] bash scripts/bench/megatron_ckpt_gpu.sh [steps (default 10)]
# Writes logs, metrics and ckpt_check.txt (one PASS/FAIL line per check, then RESULT) under $OUT.
set -uo pipefail
out=${OUT:-megatron_ckpt_out}
steps=${1:-10}
half=$((steps / 2))
mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh" "$out/gpu.txt"
runs=/tmp/megatron_ckpt
rm -rf $runs
check="$out/ckpt_check.txt"
: > "$check"
port=29600  # above the variants script's ports, so both can run at once

run() {  # run NAME CASE OVERRIDES...: one torchrun launch; the log goes to $out/CASE_NAME.log
  local name=$1 case=$2
  shift 2
  port=$((port + 1))
  torchrun --nproc_per_node=2 --master_port=$port -m aligner_ext train --config-name demo \
    policy.backend=megatron trainer.save_every="$half" trainer.eval_every="$half" trainer.progress_bar=false \
    trainer.output_dir=$runs/$case trainer.run_name="$name" "$@" > "$out/${case}_$name.log" 2>&1
}

copy_at_half() {  # copy_at_half CASE NAME: run a cut back to its middle checkpoint
  cp -r $runs/$1/a $runs/$1/$2
  rm -rf $runs/$1/$2/checkpoints/step_"$steps"
  echo "step_$half" > $runs/$1/$2/checkpoints/latest
}

one_case() {  # one_case CASE "SAVE OVERRIDES" "RESUME OVERRIDES"
  local case=$1 save=$2 resume=$3
  if ! run a "$case" $save trainer.total_steps="$steps"; then
    echo "FAIL $case: run a ($save) exited non-zero, see ${case}_a.log" | tee -a "$check"; return
  fi
  copy_at_half "$case" r
  copy_at_half "$case" c
  if ! run r "$case" $resume trainer.total_steps="$half"; then
    echo "FAIL $case: the reload at ($resume) exited non-zero, see ${case}_r.log" | tee -a "$check"
  else
    python3 - "$runs/$case" "$half" "$case" <<'PY' | tee -a "$check"
import sys
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

root, half, case = sys.argv[1], sys.argv[2], sys.argv[3]

def tensors(run):
    reader = dcp.FileSystemReader(f"{root}/{run}/checkpoints/step_{half}/megatron")
    found = {k: torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in reader.read_metadata().state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    dcp.load(found, storage_reader=reader, no_dist=True)
    return found

saved, resaved = tensors("a"), tensors("r")
kinds = sorted({k.split(".")[2] if k.startswith("optimizer.") else "weight" for k in saved})
if saved.keys() != resaved.keys():
    print(f"FAIL {case}: re-saved keys differ: only saved {sorted(saved.keys() - resaved.keys())[:5]}, "
          f"only re-saved {sorted(resaved.keys() - saved.keys())[:5]}")
else:
    diff = max((saved[k].double() - resaved[k].double()).abs().max().item() for k in saved)
    verdict = "PASS" if diff == 0 else "FAIL"
    print(f"{verdict} {case}: step {half} loaded at the new layout and re-saved: max |diff| {diff:.3g} over "
          f"{len(saved)} tensors ({', '.join(kinds)})")
PY
  fi
  if ! run c "$case" $resume trainer.total_steps="$steps"; then
    echo "FAIL $case: the resumed run at ($resume) exited non-zero, see ${case}_c.log" | tee -a "$check"; return
  fi
  python3 - "$runs/$case" "$half" "$steps" "$case" <<'PY' | tee -a "$check"
import json, math, sys

root, half, steps, case = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def history(run):
    return [json.loads(line) for line in open(f"{root}/{run}/metrics.jsonl")]

straight, resumed = history("a"), history("c")
logged = [r["step"] for r in resumed]
finite = all(math.isfinite(r["loss/total"]) for r in resumed if "loss/total" in r)
verdict = "PASS" if logged == list(range(steps + 1)) and finite else "FAIL"
first = half + 1
reward = lambda h: next(r.get("reward/mean") for r in h if r["step"] == first)
print(f"{verdict} {case}: resumed at step {half} and trained to {steps} (steps logged {logged[0]}..{logged[-1]}, "
      f"losses finite {finite}); step {first} reward/mean straight {reward(straight)} resumed {reward(resumed)}; "
      f"final val/accuracy straight {straight[-1].get('val/accuracy')} resumed {resumed[-1].get('val/accuracy')}")
PY
  for name in a r c; do
    mkdir -p "$out/$case/$name" && cp $runs/$case/$name/metrics.jsonl $runs/$case/$name/config.yaml "$out/$case/$name/" 2>/dev/null
  done
}

SECONDS=0
cases=" ${CASES:-distopt bf16} "  # CASES="distopt" runs one
[[ $cases == *" distopt "* ]] && one_case distopt "policy.tensor_model_parallel_size=2 policy.use_distributed_optimizer=true" \
  "policy.tensor_model_parallel_size=1 policy.use_distributed_optimizer=true"
[[ $cases == *" bf16 "* ]] && one_case bf16 "policy.tensor_model_parallel_size=2" \
  "policy.tensor_model_parallel_size=1 policy.pipeline_model_parallel_size=2"
echo "total $SECONDS s" >> "$out/gpu.txt"
if grep -q '^PASS' "$check" && ! grep -q '^FAIL' "$check"; then
  echo "RESULT: PASS" | tee -a "$check"
else
  echo "RESULT: FAIL" | tee -a "$check"
fi
