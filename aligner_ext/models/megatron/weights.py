"""The full HF state dict of a distributed GPTModel, assembled on every rank.

Each rank's parameters are gathered over its TP group (tensor all-gather, equal shapes), then the
per-stage results are exchanged over the PP group (object all-gather of CPU tensors), and
`convert.megatron_to_hf` assembles the HF tensors. Every rank ends with the same dict, so every
rank's HF copy of the policy (used by the generation engine and written by `save_pretrained`)
holds the current weights without a disk round trip.

Cost: the whole model passes through host memory once per call; enough for models that fit on one
GPU (the sizes this backend is tested with). A bucketed device-to-device refit is future work.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from aligner_ext.models.megatron import convert


def _tp_gathered(model: torch.nn.Module) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """This stage's shards of every TP rank, as CPU tensors keyed by (stage, tensor rank)."""
    group = parallel_state.get_tensor_model_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    stage = parallel_state.get_pipeline_model_parallel_rank()
    shards: dict[tuple[int, int], dict[str, torch.Tensor]] = {(stage, r): {} for r in range(tp)}
    for name, param in model.named_parameters():
        parts = [torch.empty_like(param) for _ in range(tp)]
        dist.all_gather(parts, param.detach().contiguous(), group=group)
        for rank, part in enumerate(parts):
            shards[(stage, rank)][name] = part.cpu()
    return shards


def gather_hf_state_dict(model: torch.nn.Module, hf_config) -> dict[str, torch.Tensor]:
    """The HF state dict (CPU tensors, the model's dtype) of the GPTModel whose shard this rank holds."""
    shards = _tp_gathered(model)
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if pp > 1:
        stages: list = [None] * pp
        dist.all_gather_object(stages, shards, group=parallel_state.get_pipeline_model_parallel_group())
        shards = {key: value for stage in stages for key, value in stage.items()}
    return convert.megatron_to_hf(shards, hf_config, parallel_state.get_tensor_model_parallel_world_size(), pp)
