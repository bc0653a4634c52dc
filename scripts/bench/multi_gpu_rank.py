"""One process of a multi-GPU table row (multi_gpu.py): `aligner-ext train` as torchrun starts it, then this
rank's peak memory written to $MULTI_GPU_PEAKS/rank<RANK>.json when it exits, however it exits: on a GPU
the caching allocator's peaks (allocated: tensors; reserved: what the process held from the device), on
the CPU the process's peak resident memory. With MULTI_GPU_LONG_TAIL=responses (or prompts) the run's engine is
made long-tailed as it is built (grpo_step_lib.LongTail or LongTailByPrompt, the GRPO benchmark's --long-tail or
--long-tail-by-prompt workload).

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


def long_tailed_engine(kind: str) -> None:
    """The loop's engine long-tailed from its build on: synchronous data parallelism measured on the workload
    that generation ahead of training is (docs/benchmarks.md). `responses`: every rank draws the same long
    responses (the call's seed); the engine's rank split then shares them out evenly, the best case of a
    synchronous step. `prompts`: the engine each rank's split drives makes a prompt's responses all long or all
    short, by its tokens, as the one-process runs that carry groups over."""
    from grpo_step_lib import LongTail, LongTailByPrompt

    from aligner_ext.trainer import build, loop

    if kind == "prompts":
        make = build.build_engine

        def build_by_prompt(*args, **kwargs):
            engine = make(*args, **kwargs)
            LongTailByPrompt(engine)
            return engine

        build.build_engine = build_by_prompt
        return

    build = loop.build_components

    def build_long_tailed(*args, **kwargs):
        parts = build(*args, **kwargs)
        LongTail(parts.engine)
        return parts

    loop.build_components = build_long_tailed


if __name__ == "__main__":  # not in the reward workers, which import this file as their main module
    from aligner_ext.cli import main

    atexit.register(write_peak)
    if os.environ.get("MULTI_GPU_LONG_TAIL"):
        long_tailed_engine(os.environ["MULTI_GPU_LONG_TAIL"])
    sys.exit(main(["train", *sys.argv[1:]]))
