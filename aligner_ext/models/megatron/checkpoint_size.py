"""The size of the Megatron backend's distributed checkpoint, estimated before step 1 from parameter
counts (trainer/disk_space.py). Imports nothing from megatron-core, so it is tested on any machine.

The checkpoint stores each global tensor once (`dist_checkpoint`: replicas are written by one rank),
so its size is the global number of values saved (every weight, or with LoRA the adapters alone)
times the bytes each takes: the weight in the training dtype, AdamW's two moments in float32, and
under bf16 or fp16 a float32 master weight (megatron-core's mixed-precision optimizer keeps one).
Each rank counts its own parameters, each divided by the ranks holding a copy of it, and the counts
are summed over the world: a weight split over TP has a copy per data-parallel rank, a weight
replicated over TP (a norm) one per TP rank too, and an expert's weight one per rank of the
experts' data-parallel and tensor-parallel groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)
ADAM_MOMENTS_BYTES = 2 * 4  # exp_avg and exp_avg_sq, float32
MASTER_BYTES = 4  # a float32 copy of each low-precision weight


@dataclass(frozen=True)
class Copies:
    """The group sizes that decide how many ranks hold a copy of a parameter."""

    data_parallel: int
    tensor_parallel: int
    expert_data_parallel: int
    expert_tensor_parallel: int

    def of(self, param: torch.nn.Parameter) -> int:
        """Ranks holding a copy of `param` (megatron-core marks experts' weights `allreduce=False` and
        TP-split ones `tensor_model_parallel`)."""
        expert = not getattr(param, "allreduce", True)
        split = getattr(param, "tensor_model_parallel", False)
        if expert:
            return self.expert_data_parallel * (1 if split else self.expert_tensor_parallel)
        return self.data_parallel * (1 if split else self.tensor_parallel)


def rank_share(params: list[torch.nn.Parameter], copies: Copies) -> float:
    """This rank's share of the global values saved: each parameter's values over its copies."""
    return sum(param.numel() / copies.of(param) for param in params)


def sharded_checkpoint_bytes(values: int, dtype: torch.dtype, optimizer: bool = True) -> int:
    """Bytes of a distributed checkpoint of `values` global values trained in `dtype` (module docstring);
    `optimizer=False`: a weights-only checkpoint (`trainer.save_optimizer=false`), the weights alone."""
    if not optimizer:
        return values * dtype.itemsize
    per_value = dtype.itemsize + ADAM_MOMENTS_BYTES + (MASTER_BYTES if dtype in LOW_PRECISION else 0)
    return values * per_value
