#!/usr/bin/env bash
# Create .venv312 (once; or the directory given as $1): Python 3.12 with megatron-core 0.19 (extra `megatron`), for the
# Megatron backend's tests (tests/megatron_env.py runs every test module that asks for megatron-core there) and for
# Megatron runs on a machine whose default Python is older: megatron-core 0.17 and later need Python >= 3.12.
# The interpreter: $ALIGNER_EXT_PYTHON312, else a working `python3.12` on PATH, else pyenv's newest 3.12.
# torch==2.13.0 first: PyPI has only its CUDA build for Python 3.12 (5 GB installed, 1.4 GB downloaded once into
# uv's cache; it runs on the CPU), the version .venv's local CPU build has. A finished environment is marked by
# .complete; a half-built one is built again.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv312}
if [ -f "$venv/.complete" ]; then
  exit 0
fi
python=${ALIGNER_EXT_PYTHON312:-}
if [ -z "$python" ] && python3.12 -V >/dev/null 2>&1; then
  python=python3.12
fi
if [ -z "$python" ] && command -v pyenv >/dev/null; then
  python=$(ls -d "$(pyenv root)"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -n 1)
fi
if [ -z "$python" ]; then
  echo "scripts/setup_megatron_env.sh: no Python 3.12 found (megatron-core 0.19 needs Python >= 3.12): install one" \
    "(pyenv install 3.12) or set ALIGNER_EXT_PYTHON312 to its interpreter" >&2
  exit 3
fi
rm -rf "$venv"
source scripts/free_space.sh
need_free_gb "$(dirname "$venv")" 8 "building $venv (5.3 GB installed, and uv's cache of the downloads)"
"$python" -m venv "$venv"
source scripts/installer.sh
installer "$venv"
"${install[@]}" torch==2.13.0
"${install[@]}" -c docker/constraints.txt -e '.[dev,megatron]'
touch "$venv/.complete"
