"""Refit: copy the weights of a distributed GPTModel into every rank's HF model, in place, on the device.

Every rank's HF copy of the policy (sampled by the generation engine, written by `save_pretrained`)
must hold the current weights after each `MegatronPolicy.train` call. Per Megatron parameter:
1. all-gather the shards of the TP group into one temporary [TP * rows, ...] tensor on the device
   (norm weights are replicated: this rank's own copy is used, megatron-core keeps them equal);
2. copy it into the HF parameters it maps to through views, in `convert.py`'s layouts: vocabulary
   padding dropped, row-parallel matrices interleaved back, q/k/v unfused, gate/up split;
3. with PP > 1, broadcast each HF parameter over the PP group from the stage that holds it, straight
   into the other stages' HF parameters.
No host copy, no pickled objects, no full-model allocation (the largest temporary is the gathered
embedding). Only slicing and copying, so the HF copy equals `convert.megatron_to_hf` of the shards
bit for bit (tests/megatron/test_megatron_tp_pp.py); scripts/bench/refit_bench.py times it.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from aligner_ext.models.megatron import convert

LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
LAYER_HF_NAME = re.compile(r"model\.layers\.(\d+)\.")


@torch.no_grad()
def refit_hf_model(core: torch.nn.Module, hf_model: torch.nn.Module, hf_config) -> None:
    """Copy the GPTModel whose shard this rank holds into `hf_model`'s parameters (same on every rank)."""
    hf = dict(hf_model.named_parameters())  # a tied lm_head is the embedding's parameter, listed once
    expected = convert.expected_hf_keys(hf_config)
    if set(hf) != expected:
        raise ValueError(f"HF refit: the HF model lacks {sorted(expected - set(hf))[:8]}, "
                         f"has unexpected {sorted(set(hf) - expected)[:8]}")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp, stage = parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_rank()
    per_stage = hf_config.num_hidden_layers // pp
    written: list[str] = []
    for name, param in core.named_parameters():
        full = param if _replicated(name) else _tp_gathered(param, tp)
        written += _copy_into_hf(name, full, tp, hf, hf_config, stage * per_stage)
    owned = sorted(name for name in hf if _stage_of(name, per_stage, pp) == stage)
    if sorted(written) != owned:
        raise RuntimeError(f"HF refit on stage {stage}: wrote {sorted(set(written) - set(owned))[:8]} "
                           f"beyond its own, missed {sorted(set(owned) - set(written))[:8]}")
    if pp > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        works = [dist.broadcast(param, group_src=_stage_of(name, per_stage, pp), group=group, async_op=True)
                 for name, param in hf.items()]
        for work in works:
            work.wait()


def _replicated(name: str) -> bool:
    return name.endswith("layernorm.weight")  # input, pre-MLP, final and Qwen3's q/k norms


def _tp_gathered(param: torch.Tensor, tp: int) -> torch.Tensor:
    """Every TP rank's shard of `param`, concatenated along dim 0: [tp * rows, ...] on param's device."""
    if tp == 1:
        return param
    full = param.new_empty((tp * param.shape[0], *param.shape[1:]))
    dist.all_gather_into_tensor(full, param.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return full


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


def _copy_into_hf(name: str, full: torch.Tensor, tp: int, hf: dict, hf_config, first_layer: int) -> list[str]:
    """Copy one TP-gathered Megatron tensor into the HF parameters it maps to; return their names."""
    vocab = hf_config.vocab_size
    if name == "embedding.word_embeddings.weight":
        _put(hf["model.embed_tokens.weight"], full[:vocab])
        return ["model.embed_tokens.weight"]
    if name == "output_layer.weight":
        if hf_config.tie_word_embeddings:
            return []  # the last stage's copy of the embedding (PP > 1), kept equal by megatron-core
        _put(hf["lm_head.weight"], full[:vocab])
        return ["lm_head.weight"]
    if name == "decoder.final_layernorm.weight":
        _put(hf["model.norm.weight"], full)
        return ["model.norm.weight"]
    match = LAYER_NAME.fullmatch(name)
    if match is None:
        raise RuntimeError(f"HF refit: no HF parameter for the Megatron parameter {name}")
    prefix, suffix = f"model.layers.{first_layer + int(match.group(1))}.", match.group(2)
    for hf_name, mc_name, how in convert.layer_tensors(hf_config):
        if suffix == mc_name and how == "row":  # TP shards are column blocks: [tp, out, in/tp] -> [out, tp, in/tp]
            _put(hf[prefix + hf_name].unflatten(1, (tp, -1)), full.unflatten(0, (tp, -1)).transpose(0, 1))
            return [prefix + hf_name]
        if suffix == mc_name:
            _put(hf[prefix + hf_name], full)
            return [prefix + hf_name]
    if suffix.startswith("self_attention.linear_qkv."):
        kind = suffix.rsplit(".", 1)[1]
        names = [f"{prefix}self_attn.{p}_proj.{kind}" for p in "qkv"]
        for hf_name, part in zip(names, convert.unfuse_qkv(full, hf_config)):
            _put(hf[hf_name], part)
        return names
    if suffix == "mlp.linear_fc1.weight":  # per TP rank: [gate rows of the rank; up rows of the rank]
        halves = full.unflatten(0, (tp, 2, -1))
        names = [f"{prefix}mlp.gate_proj.weight", f"{prefix}mlp.up_proj.weight"]
        for index, hf_name in enumerate(names):
            _put(hf[hf_name].unflatten(0, (tp, -1)), halves[:, index])
        return names
    raise RuntimeError(f"HF refit: no HF parameter for the Megatron parameter {name}")
