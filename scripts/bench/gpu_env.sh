# Sourced by the GPU scripts of this folder on the lent GPU machine (carry .whl and .devsite): every
# cp312 wheel of .whl/ into /tmp/site (the Megatron scripts need megatron-core and psutil, its
# checkpoint writer's; the TRL comparison trl, datasets, dill and multiprocess; once per machine and
# set of wheels), the pure-Python packages the machine lacks (Hydra, OmegaConf, math-verify) from
# .devsite/ on PYTHONPATH, and the GPUs' names written to the file given as $1.
if [ "$(ls .whl)" != "$(cat /tmp/site/.wheels 2>/dev/null)" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  ls .whl > /tmp/site/.wheels
fi
export PYTHONPATH=/tmp/site:$PWD/.devsite:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1 PYTHONWARNINGS=ignore
# Runs that share a GPU grow and shrink their batches step by step: segments that can grow keep the
# caching allocator from fragmenting the memory they all draw on.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$1"
