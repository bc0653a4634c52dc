#!/usr/bin/env bash
# Create .venv (once) and install aligner_ext with its test extras.
# torch==2.13.0 is installed first: on the CPU machines it is a local CPU build, while a bare
# `torch` requirement would pull a multi-GB CUDA build. On a GPU machine install torch yourself first.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install --quiet torch==2.13.0
fi
.venv/bin/pip install --quiet --disable-pip-version-check -e '.[dev,megatron]'
