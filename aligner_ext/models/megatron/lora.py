"""LoRA on the Megatron backend: an adapter beside each column- and row-parallel linear of the
GPTModel, sharded as that linear's weight (docs/lora.md). megatron-core (0.16, 0.19) has no adapter module
of its own, so this is one, written once for the four linears of a layer.

An adapted linear computes `y = x W^T + (x A^T) B^T * alpha / r` with W frozen and, per TP rank:
- column-parallel (`linear_qkv`, `linear_fc1`, output rows split): A [r, in] replicated, B [out / TP, r]
  sharded on the output dim in the weight's own row layout (Megatron's per-group q/k/v rows, the
  rank's [gate; up] rows). `u = x A^T` is the same on every rank; its gradient is summed over TP
  (`copy_to_tensor_model_parallel_region`), so A's gradient is whole on every rank. With sequence
  parallelism x is this rank's sequence shard: u is all-gathered over the sequence, and A's
  gradient, from this rank's tokens only, is summed over TP as megatron-core sums the norms'
  (`sequence_parallel` mark).
- row-parallel (`linear_proj`, `linear_fc2`, input columns split): A [r, in / TP] sharded on the
  input dim, B [out, r] replicated. `u = x A^T` is a partial sum, summed over TP
  (`reduce_from_tensor_model_parallel_region`; under sequence parallelism reduce-scattered over the
  sequence, and B's gradient summed over TP as above).
So every rank's output equals the unsharded layer's (tests/megatron/test_megatron_lora.py: TP=2
against TP=1, log-probs, gradients and an update).

Decisions:
- Megatron fuses q/k/v into one linear and gate/up into another, so one adapter covers each fused
  linear: A shared by q, k and v (rank r over the three), where peft's adapters on the HF backend
  give each projection an A of its own. `policy.lora.target_modules` is matched against the HF names
  of the projections (`model.layers.3.self_attn.q_proj`); a fused linear is adapted when all of its
  projections match and refused when only some do.
- A is drawn from a generator seeded by the layer's global number and the linear, whole, then
  sliced to the rank's shard: every layout starts from the same adapters, and a resume at another
  layout reshards them (`sharded_state_dict`, the fused gate/up rows by megatron-core's own swiglu
  factory).
- The adapters sit in the layer module beside the linear they adapt (`linear_qkv_lora`, ...), a
  forward hook on the linear adds their output; `enabled` switches them off (the KL reference).
"""

from __future__ import annotations

import contextlib
import math
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from aligner_ext.adapters import LowRank
from aligner_ext.architecture import architecture
from aligner_ext.errors import ConfigError
from aligner_ext.models.lora import target_pattern
from aligner_ext.models.megatron.convert import unfuse_qkv
from aligner_ext.models.settings import LoraConfig

# Megatron linear -> (its parent in the layer, the HF projections it fuses, column-parallel)
LINEARS = {
    "linear_qkv": ("self_attention", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), True),
    "linear_proj": ("self_attention", ("self_attn.o_proj",), False),
    "linear_fc1": ("mlp", ("mlp.gate_proj", "mlp.up_proj"), True),
    "linear_fc2": ("mlp", ("mlp.down_proj",), False),
}
SUFFIX = "_lora"  # the adapter of `linear_qkv` is the layer's `self_attention.linear_qkv_lora`
INIT_SEED = 20251125


class ParallelLoRA(torch.nn.Module):
    """The adapter of one column- or row-parallel linear (module docstring); `forward(x)` is its term."""

    def __init__(self, linear: torch.nn.Module, name: str, cfg: LoraConfig, layer: int, sequence_parallel: bool):
        super().__init__()
        self.name, self.column, self.layer = name, LINEARS[name][2], layer
        self.scale = cfg.alpha / cfg.rank
        self.sequence_parallel = sequence_parallel
        self.enabled = True
        tp = parallel_state.get_tensor_model_parallel_world_size()
        rank = parallel_state.get_tensor_model_parallel_rank()
        weight = linear.weight
        rows, columns = weight.shape
        whole_a = initial_a(cfg, layer, name, columns if self.column else columns * tp)
        a = whole_a if self.column else whole_a.chunk(tp, dim=1)[rank]
        self.a = torch.nn.Parameter(a.to(device=weight.device, dtype=weight.dtype))
        self.b = torch.nn.Parameter(torch.zeros(rows, cfg.rank, device=weight.device, dtype=weight.dtype))
        sharded, replicated = (self.b, self.a) if self.column else (self.a, self.b)
        set_tensor_model_parallel_attributes(sharded, is_parallel=True, dim=0 if self.column else 1, stride=1)
        if sequence_parallel:
            replicated.sequence_parallel = True  # its gradient comes from this rank's tokens: summed over TP
        self.dropout = torch.nn.Dropout(cfg.dropout) if cfg.dropout > 0 else torch.nn.Identity()
        linear.register_forward_hook(self._add_to_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = F.linear(self.dropout(x), self.a)
        if self.column:
            u = (gather_from_sequence_parallel_region(u) if self.sequence_parallel
                 else copy_to_tensor_model_parallel_region(u))
        else:
            u = (reduce_scatter_to_sequence_parallel_region(u) if self.sequence_parallel
                 else reduce_from_tensor_model_parallel_region(u))
        return F.linear(u, self.b) * self.scale

    def _add_to_output(self, linear, args, output):
        """The linear's forward hook: (output + this adapter's term, bias)."""
        if not self.enabled:
            return output
        out, bias = output
        return (out + self(args[0])).to(out.dtype), bias

    def low_rank(self) -> LowRank:
        """The adapter as the rollout engine's decoder reads it (its tensors, not copies)."""
        return LowRank(self.a, self.b, self.scale)

    @torch.no_grad()
    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of W + B A * scale, a new tensor in W's dtype (W keeps its values)."""
        exact = torch.promote_types(weight.dtype, torch.float32)
        return (weight.to(exact) + (self.b.to(exact) @ self.a.to(exact)) * self.scale).to(weight.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """A and B as distributed-checkpoint tensors, sharded as they are (module docstring)."""
        state = self.state_dict(prefix="", keep_vars=True)
        axis = {"b": 0} if self.column else {"a": 1}
        sharded = make_sharded_tensors_for_checkpoint(state, prefix, axis, sharded_offsets)
        if self.name == "linear_fc1":
            singleton = (metadata or {}).get("singleton_local_shards", False)
            sharded[f"{prefix}b"] = apply_swiglu_sharded_factory(sharded[f"{prefix}b"], sharded_offsets, singleton)
        return sharded


def initial_a(cfg: LoraConfig, layer: int, name: str, columns: int) -> torch.Tensor:
    """The whole A [r, columns] of a layer's linear, the same on every rank and layout (float32, CPU):
    kaiming uniform (peft's default: bound 1 / sqrt(columns)) or normal with std 1 / r."""
    generator = torch.Generator().manual_seed(INIT_SEED + 8 * layer + list(LINEARS).index(name))
    a = torch.empty(cfg.rank, columns)
    if cfg.init == "kaiming":
        return torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
    return torch.nn.init.normal_(a, std=1 / cfg.rank, generator=generator)


def attach(core: torch.nn.Module, cfg: LoraConfig) -> list[ParallelLoRA]:
    """Freeze `core` (this rank's GPTModel) and give the linears `cfg.target_modules` names an adapter
    each; the adapters, in order. A target list that matches nothing, or some but not all of a fused
    linear's projections, is a ConfigError."""
    core.requires_grad_(False)
    adapted = [adapted_linears(cfg.target_modules, layer) for layer in range(core.config.num_layers)]
    if core.config.pipeline_model_parallel_size > 1 and any(names != adapted[0] for names in adapted):
        raise ConfigError(f"policy.lora.target_modules={cfg.target_modules} adapts some layers' linears and not "
                          "others': with pipeline parallelism every layer needs the same adapters (the rollout "
                          "engine gathers the stages' layers alike)")
    adapters = []
    for module in core.decoder.layers:
        layer = module.layer_number - 1  # megatron-core counts the layers of every stage from 1
        for name in adapted[layer]:
            owner = getattr(module, LINEARS[name][0])
            adapter = ParallelLoRA(getattr(owner, name), name, cfg, layer, core.config.sequence_parallel)
            setattr(owner, name + SUFFIX, adapter)
            adapters.append(adapter)
    if not adapters:
        raise ConfigError(f"policy.lora.target_modules={cfg.target_modules} matches none of the projections the "
                          "Megatron backend adapts (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)")
    return adapters


def adapted_linears(patterns: list[str], layer: int) -> list[str]:
    """The Megatron linears of global layer `layer` whose HF projections `patterns` take (module
    docstring); a fused linear of which they take some projections but not all is a ConfigError."""
    pattern = target_pattern(patterns)
    names = []
    for name, (_, projections, _) in LINEARS.items():
        matched = [bool(pattern.fullmatch(f"model.layers.{layer}.{projection}")) for projection in projections]
        if any(matched) and not all(matched):
            raise ConfigError(f"policy.lora.target_modules={patterns} takes some of "
                              f"{', '.join(p.rsplit('.', 1)[1] for p in projections)} but not all: the Megatron "
                              "backend fuses them into one linear with one adapter; name all or none")
        if all(matched):
            names.append(name)
    return names


def is_adapter(name: str) -> bool:
    """Whether a GPTModel parameter name is an adapter's."""
    return re.search(rf"{SUFFIX}\.[ab]$", name) is not None


def adapters_by_weight(core: torch.nn.Module) -> dict[str, ParallelLoRA]:
    """Each adapted linear's weight name in `core` -> its adapter."""
    return {f"{prefix.removesuffix(SUFFIX)}.weight": module for prefix, module in core.named_modules()
            if isinstance(module, ParallelLoRA)}


@contextlib.contextmanager
def adapters_off(adapters: list[ParallelLoRA]):
    """The base model: every adapter switched off while the block runs."""
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True


def peft_state(adapters: list[ParallelLoRA], hf_config) -> dict[str, torch.Tensor]:
    """Every adapter of the model as peft names and lays it out for the HF model (on the host, on every
    rank: gathered over TP, then over PP). A fused linear's adapter becomes one per projection, each
    with the shared A and its rows of B, which computes the same; Phi-3's checkpoint-fused
    `qkv_proj` and `gate_up_proj` keep one."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    fused = architecture(hf_config).fused_checkpoint
    mine = {}
    for adapter in adapters:
        a = adapter.a if adapter.column else _tp_gathered(adapter.a, tp, dim=1)
        b = _tp_gathered(adapter.b, tp, dim=0) if adapter.column else adapter.b
        prefix = f"base_model.model.model.layers.{adapter.layer}."
        for projection, rows in _hf_rows(adapter.name, b, hf_config, tp, fused):
            mine[f"{prefix}{projection}.lora_A.weight"] = a.detach().cpu().clone()
            mine[f"{prefix}{projection}.lora_B.weight"] = rows.detach().cpu().clone()
    stages = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, mine, group=parallel_state.get_pipeline_model_parallel_group())
    return {name: tensor for stage in stages for name, tensor in stage.items()}


def _tp_gathered(tensor: torch.Tensor, tp: int, dim: int) -> torch.Tensor:
    if tp == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(tp)]
    dist.all_gather(parts, tensor.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


def _hf_rows(name: str, b: torch.Tensor, hf_config, tp: int, fused: bool) -> list[tuple[str, torch.Tensor]]:
    """(HF projection, its rows of the whole B [out, r] in HF's order) of a Megatron linear's adapter."""
    projections = LINEARS[name][1]
    if name == "linear_qkv":
        parts = unfuse_qkv(b, hf_config)
    elif name == "linear_fc1":  # per TP rank: [gate rows of the rank; up rows of the rank]
        halves = b.unflatten(0, (tp, 2, -1))
        parts = (halves[:, 0].flatten(0, 1), halves[:, 1].flatten(0, 1))
    else:
        return [(projections[0], b)]
    if fused:
        return [("self_attn.qkv_proj" if name == "linear_qkv" else "mlp.gate_up_proj", torch.cat(parts))]
    return list(zip(projections, parts))
