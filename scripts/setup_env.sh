#!/usr/bin/env bash
# Create .venv (once) and install aligner_ext with its test extras, under docker/constraints.txt (the
# versions the test suite passed with; the container installs under the same file). Not the `megatron` extra:
# megatron-core 0.19 needs Python >= 3.12, and .venv is the machine's python3 (3.11 on the CPU machines); the
# tests that need it run in .venv312 (scripts/setup_megatron_env.sh, built by the test run: tests/megatron_env.py).
# torch==2.13.0 is installed first: on the CPU machines it is a local CPU build, while a bare
# `torch` requirement would pull a multi-GB CUDA build. On a GPU machine install torch yourself first.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
source scripts/installer.sh
installer .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  "${install[@]}" torch==2.13.0
fi
# verifiers 0.4.0 (extra aligner_ext[verifiers]) asks for openai<3, while the constraints pin openai 3.57.0, with which
# its environments pass the tests: it is installed without its dependencies, and its other requirements
# (docker/verifiers-requirements.txt) are resolved with the rest, under the constraints, in one call: apart, the
# openenv extra's fastmcp and verifiers' mcp==2.0.0 do not fit.
"${install[@]}" --no-deps verifiers==0.4.0
"${install[@]}" -c docker/constraints.txt -e '.[dev,openenv]' -r docker/verifiers-requirements.txt
# The CPU build of torch comes without Triton; the tests run the rollout engine's Triton kernels in
# Triton's interpreter (tests/conftest.py). CUDA builds of torch bring their own Triton.
if ! .venv/bin/python -c "import triton" 2>/dev/null; then
  "${install[@]}" triton==3.6.0
fi
