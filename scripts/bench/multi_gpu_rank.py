"""One process of a multi-GPU table row (multi_gpu.py): `aligner-ext train` as torchrun starts it, then this
rank's peak memory written to $MULTI_GPU_PEAKS/rank<RANK>.json when it exits, however it exits: on a GPU
the caching allocator's peaks (allocated: tensors; reserved: what the process held from the device), on
the CPU the process's peak resident memory.

    torchrun --nproc_per_node=2 scripts/bench/multi_gpu_rank.py OVERRIDES...
"""

import atexit
import json
import os
import resource
import sys
from pathlib import Path

GIB = 2**30


def peak_gib() -> dict[str, float]:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return {"allocated": torch.cuda.max_memory_allocated() / GIB, "reserved": torch.cuda.max_memory_reserved() / GIB}
    return {"resident": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB}  # Linux counts KiB


def write_peak() -> None:
    folder = Path(os.environ["MULTI_GPU_PEAKS"])
    (folder / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(peak_gib()))


if __name__ == "__main__":  # not in the reward workers, which import this file as their main module
    from aligner_ext.cli import main

    atexit.register(write_peak)
    sys.exit(main(["train", *sys.argv[1:]]))
