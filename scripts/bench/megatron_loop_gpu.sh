#!/usr/bin/env bash
# The whole training loop with the Megatron backend on the lent 2-GPU machine: the embedded demo job
# (conf/demo.yaml) at TP=2 under torchrun (bf16 where supported), then the same run cut back to its
# middle checkpoint and resumed, and the largest differences between the two final checkpoints (the HF
# weights, and every tensor of the distributed checkpoint: weights, Adam moments, master weights).
# megatron-core travels as its cp312 wheel in .whl/ with psutil (the distributed checkpoint writer
# needs it), the pure-Python packages the machine lacks in .devsite/ (see megatron_gpu.sh). Usage there:
#   bash scripts/bench/megatron_loop_gpu.sh [steps (default 30)] [extra overrides...]
# Writes metrics, summaries and the logs under $OUT (or ./megatron_loop_out).
set -euo pipefail
out=${OUT:-megatron_loop_out}
steps=${1:-30}
shift || true
mkdir -p "$out"
source "$(dirname "$0")/gpu_env.sh" "$out/gpu.txt"
runs=/tmp/megatron_loop
rm -rf "$runs"  # a run directory left by an earlier call would be resumed instead of trained
run() {
  torchrun --nproc_per_node=2 --master_port="$2" -m aligner_ext train --config-name demo \
    policy.backend=megatron policy.tensor_model_parallel_size=2 trainer.total_steps="$steps" \
    trainer.save_every=$((steps / 2)) trainer.eval_every=$((steps / 2)) trainer.progress_bar=false \
    trainer.output_dir=$runs trainer.run_name="$1" "${@:3}" > "$out/$1.log" 2>&1
}
SECONDS=0; run a 29541 "$@"; echo "run a ($steps steps): $SECONDS s" | tee -a "$out/times.txt"
cp -r $runs/a $runs/b
rm -rf $runs/b/checkpoints/step_"$steps"
echo "step_$((steps / 2))" > $runs/b/checkpoints/latest
SECONDS=0; run b 29542 "$@"; echo "run b (resumed at step $((steps / 2))): $SECONDS s" | tee -a "$out/times.txt"
for name in a b; do
  mkdir -p "$out/$name" && cp $runs/$name/metrics.jsonl $runs/$name/summary.json $runs/$name/config.yaml "$out/$name/"
done
python3 - "$runs" "$steps" <<'PY' | tee "$out/resume_check.txt"
import sys
import torch.distributed.checkpoint as dcp
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

runs, steps = sys.argv[1], sys.argv[2]


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def megatron_tensors(run: str) -> dict:
    """Every tensor of the run's final distributed checkpoint: weights, Adam moments, master weights."""
    reader = dcp.FileSystemReader(f"{runs}/{run}/checkpoints/step_{steps}/megatron")
    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
               for key, meta in reader.read_metadata().state_dict_metadata.items()
               if isinstance(meta, TensorStorageMetadata)}
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


a = load_file(f"{runs}/a/checkpoints/step_{steps}/model.safetensors")
b = load_file(f"{runs}/b/checkpoints/step_{steps}/model.safetensors")
print(f"dtype {next(iter(a.values())).dtype}; max |straight - resumed| over {len(a)} tensors: {largest_difference(a, b):.3g}")
a, b = megatron_tensors("a"), megatron_tensors("b")
print(f"distributed checkpoint (weights and optimizer state): max |straight - resumed| over {len(a)} tensors: "
      f"{largest_difference(a, b):.3g}")
PY
