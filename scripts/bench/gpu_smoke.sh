#!/usr/bin/env bash
# The embedded default job on one GPU (HF backend, bf16 where supported), run on the lent GPU
# machine. Pure-Python packages the machine lacks travel in .devsite/ (copied from a local venv:
# hydra, omegaconf, antlr4, math_verify, latex2sympy2_extended). Usage there:
#   bash scripts/bench/gpu_smoke.sh [extra overrides...]
# Writes metrics, the plot and the log under $OUT (or ./gpu_smoke_out).
set -euo pipefail
out=${OUT:-gpu_smoke_out}
mkdir -p "$out"
export PYTHONPATH=$PWD/.devsite:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'bf16', torch.cuda.is_bf16_supported())" | tee -a "$out/gpu.txt"
python3 -m aligner_ext demo trainer.output_dir=/tmp/runs trainer.run_name=gpu trainer.progress_bar=false "$@" 2>&1 | tee "$out/demo.log"
cp /tmp/runs/gpu/metrics.jsonl /tmp/runs/gpu/reward_accuracy.png /tmp/runs/gpu/summary.json /tmp/runs/gpu/config.yaml "$out/"
