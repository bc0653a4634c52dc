"""Refit: copy the weights of a distributed GPTModel into every rank's HF model, in place, on the device.

Every rank's HF copy of the policy (sampled by the generation engine, written by `save_pretrained`)
must hold the current weights after each `MegatronPolicy.train` call. Per Megatron parameter:
1. all-gather the shards of the TP group into one temporary [TP * rows, ...] tensor on the device
   (replicated norm weights, `convert.is_replicated`: this rank's own copy is used, megatron-core
   keeps them equal; OLMo's q/k norms are split like the heads and gathered);
2. copy it into the HF parameters it maps to (`convert.hf_tensors`, the mapping `megatron_to_hf`
   uses too): vocabulary padding dropped, row-parallel matrices interleaved back, q/k/v unfused,
   gate/up split (fused again for Phi-3's checkpoint layout);
3. a mixture of experts' local experts under expert parallelism (EP): after the TP gather (over the
   expert-TP group), all-gather the EP group's copies of the local expert: EP rank q's is global
   expert q * count / EP + its local index;
4. with PP > 1, broadcast each HF parameter over the PP group from the stage that holds it, straight
   into the other stages' HF parameters.
With LoRA adapters (`lora.py`) each adapted weight's shard is merged first (W + B A * alpha / r, a
new tensor: the GPTModel's weight keeps its values) and the adapters themselves map to nothing: the
HF copy is the merged model.
No host copy, no pickled objects, no full-model allocation (temporaries: the gathered tensor and,
for row-parallel, q/k/v and gate/up tensors, one rearranged copy of it). Only slicing and copying,
so the HF copy equals `convert.megatron_to_hf` of the shards bit for bit (tests/megatron/test_megatron_tp_pp.py); scripts/bench/refit_bench.py at 4e17684 times it.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from aligner_ext.architecture import Architecture, architecture
from aligner_ext.models.megatron import convert, lora

LAYER_HF_NAME = re.compile(r"model\.layers\.(\d+)\.")


@torch.no_grad()
def refit_hf_model(core: torch.nn.Module, hf_model: torch.nn.Module, hf_config) -> None:
    """Copy the GPTModel whose shard this rank holds into `hf_model`'s parameters (same on every rank)."""
    hf = dict(hf_model.named_parameters())  # a tied lm_head is the embedding's parameter, listed once
    arch = architecture(hf_config)
    expected = convert.expected_hf_keys(hf_config, arch)
    if set(hf) != expected:
        raise ValueError(f"HF refit: the HF model lacks {sorted(expected - set(hf))[:8]}, "
                         f"has unexpected {sorted(set(hf) - expected)[:8]}")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp, stage = parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_rank()
    per_stage = hf_config.num_hidden_layers // pp
    ep = parallel_state.get_expert_model_parallel_world_size()
    local_experts = arch.experts.count // ep if arch.experts else 0
    written: list[str] = []
    adapters = lora.adapters_by_weight(core)
    for name, param in core.named_parameters():
        if lora.is_adapter(name):
            continue
        if name in adapters:
            param = adapters[name].merged(param)
        if convert.is_expert(name):
            full = _tp_gathered(param, tp, parallel_state.get_expert_tensor_parallel_group())
            for ep_rank, copy in enumerate(_ep_gathered(full, ep)):
                written += _copy_into_hf(name, copy, tp, hf, hf_config, arch, stage * per_stage, ep_rank * local_experts)
            continue
        full = param if convert.is_replicated(name, arch) else _tp_gathered(param, tp)
        written += _copy_into_hf(name, full, tp, hf, hf_config, arch, stage * per_stage)
    owned = sorted(name for name in hf if _stage_of(name, per_stage, pp) == stage)
    if sorted(set(written)) != owned:  # set: a stacked expert tensor is written expert by expert
        raise RuntimeError(f"HF refit on stage {stage}: wrote {sorted(set(written) - set(owned))[:8]} "
                           f"beyond its own, missed {sorted(set(owned) - set(written))[:8]}")
    if pp > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        works = [dist.broadcast(param, group_src=_stage_of(name, per_stage, pp), group=group, async_op=True)
                 for name, param in hf.items()]
        for work in works:
            work.wait()


def _tp_gathered(param: torch.Tensor, tp: int, group=None) -> torch.Tensor:
    """Every TP rank's shard of `param`, concatenated along dim 0: [tp * rows, ...] on param's device
    (`group`: the TP group, or the experts' TP group for an expert's weight)."""
    if tp == 1:
        return param
    full = param.new_empty((tp * param.shape[0], *param.shape[1:]))
    dist.all_gather_into_tensor(full, param.contiguous(), group=group or parallel_state.get_tensor_model_parallel_group())
    return full


def _ep_gathered(full: torch.Tensor, ep: int) -> list[torch.Tensor]:
    """Every EP rank's copy of a (TP-gathered) local expert's weight, by EP rank."""
    if ep == 1:
        return [full]
    everyone = full.new_empty((ep * full.shape[0], *full.shape[1:]))  # concatenated along dim 0, as gloo gathers
    dist.all_gather_into_tensor(everyone, full.contiguous(), group=parallel_state.get_expert_model_parallel_group())
    return list(everyone.chunk(ep))


def _stage_of(hf_name: str, per_stage: int, pp: int) -> int:
    """The pipeline stage that holds an HF parameter: its layer's, else first (embedding) or last."""
    layer = LAYER_HF_NAME.match(hf_name)
    if layer:
        return int(layer.group(1)) // per_stage
    return 0 if hf_name == "model.embed_tokens.weight" else pp - 1


def _put(target: torch.Tensor, value: torch.Tensor) -> None:
    if target.shape != value.shape:  # copy_ would broadcast silently
        raise RuntimeError(f"HF refit: shape {tuple(value.shape)} does not fit {tuple(target.shape)}")
    target.copy_(value)


def _copy_into_hf(name: str, full: torch.Tensor, tp: int, hf: dict, hf_config, arch: Architecture,
                  first_layer: int, expert_offset: int = 0) -> list[str]:
    """Copy one TP-gathered Megatron tensor into the HF parameters it maps to; return their names."""
    pairs = convert.hf_tensors(name, full, tp, hf_config, arch, first_layer, expert_offset)
    names = []
    for hf_name, value in pairs:
        base, expert = convert.split_expert_slice(hf_name)
        _put(hf[base] if expert is None else hf[base][expert], value)
        names.append(base)
    return names
