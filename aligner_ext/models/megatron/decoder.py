"""The rollout engine's model side on the Megatron GPTModel's own tensor-parallel shards.

`MegatronGenerationModel` is what the Megatron backend hands the rollout engine instead of an HF
copy of the policy: the GPTModel the optimizer updates, with the HF config. The engine asks it for
its decoder (`rollout_decoder`), a `generation.decoder.Decoder` whose layer weights are the
GPTModel's parameters themselves (nothing copied, nothing to sync after an optimizer step; a mixture
of experts' stacked experts aside, below):

- each rank holds its shard of every layer: its K/V groups and their query heads (the fused q/k/v
  matrix in Megatron's per-group layout, `Shape.qkv_per_group`), its columns of the MLP. The KV
  cache holds only this rank's K/V heads, so it shrinks with TP like the weights;
- the attention's and the MLP's output projections are row-parallel: each rank's partial output is
  summed over the TP group (`reduce`, one all-reduce each per layer, as in training's forward);
- the vocabulary-parallel embedding looks up the ids in this rank's rows and sums over the group;
  the output head's logits over this rank's vocabulary rows are all-gathered, and the padded rows
  past the real vocabulary dropped.

So every rank of a TP group computes the same logits and, from the same seeds, samples the same
tokens: the ranks of a TP group decode the same requests in lockstep (the rank split shares a call's
requests over the other ranks, `generation/sharded.py`: the data-parallel ones, and with PP the
pipeline ones too, below). Every family `aligner_ext/architecture.py` describes runs here as in the
HF decoder (its norms, q/k norms, activation, RoPE tables and windows from the HF config), on the
GPTModel's parameter names per layer: `input_layernorm`, `pre_mlp_layernorm` (where the family has
them), `self_attention.output_norm` and `mlp.output_norm` (the norms of the attention's and the
MLP's outputs: OLMo, Gemma 3), `self_attention.{q,k}_layernorm` (per head, replicated; OLMo's over
the whole projection, this rank's heads in Megatron's per-group order: the norm's mean of squares is
summed over the TP group, `reduce`), `self_attention.linear_qkv`, `self_attention.linear_proj`,
`mlp.linear_fc1` (this rank's gate rows, then its up rows), `mlp.linear_fc2`. Gemma's embedding
scale applies after the vocabulary-parallel lookup's sum. LoRA adapters (`lora.py`, `*_lora.a` and
`.b` beside their linear) enter as `adapters.LowRank` terms of their shards: a column-parallel one's
B rows are this rank's output rows, a row-parallel one's partial product is summed over the group
with the base product's.

A mixture of experts (Qwen3-MoE, Qwen2-MoE; megatron-core's `SequentialMLP`), per layer:
`mlp.router.weight` [E, h] (replicated: every rank routes the full hidden state alike, as the engine
runs no sequence parallelism), the local experts' `mlp.experts.local_experts.{e}.linear_fc1.weight`
[2I/TP, h] (this rank's gate rows, then its up rows) and `.linear_fc2.weight` [h, I/TP], stacked as
transformers stacks them, [E, 2I/TP, h] and [E, h, I/TP], for `experts_mlp` (`torch._grouped_mm`
needs one 3D tensor per layer); Qwen2-MoE's shared expert `mlp.shared_experts.linear_fc1` /
`linear_fc2` (split as a dense MLP's) and its replicated `gate_weight`. Each expert's output over
this rank's columns, and so the routing-weighted sum and the gated shared expert's, is a partial sum
over TP: the MLP output's `reduce` sums it. The stacked tensors are views where the experts lie back
to back in one storage (the other stages' layers under PP: `PipelineGather`'s flat buffers hold each
layer's parameters `in_stacking_order`), else a copy: this stage's own experts, separate parameters
(megatron-core's DDP keeps them in its own buffer, in its own order; re-pointing them into a stacked
one would break it), are stacked into one buffer per layer and matrix, refilled in place before
every generate call (`MegatronDecoder.refresh`, which the engine calls; after each optimizer step
they hold the new values). Its memory cost: one copy of this rank's own stage's expert weights (at
PP=1, this rank's TP shard of every expert: most of a mixture of experts' weights). Routing is
transformers' (`route`), which picks megatron-core's router's experts (`model.moe_options`;
tests/megatron/test_megatron_rollout.py). The experts each token took are recorded
(`return_routing`) as on the HF backend, for the Megatron policy's mismatch metric and routing replay
(`models/megatron/moe.py`).

Under expert parallelism (EP > 1, over the data-parallel ranks) a rank holds E / EP experts, those
of its EP rank (global index = EP rank * E / EP + local index, as `convert.py` splits them), stacked
alike, and decodes its own share of the requests (the rank split's group holds its EP group). Each
MoE layer exchanges the tokens over megatron-core's expert-model-parallel group
(`generation/decoder.py::ExpertExchange`: all-gather, this rank's experts, reduce-scatter), whose
ranks share this rank's TP rank and stage: under TP each exchange carries one TP rank's partial
outputs, summed over TP after it; under PP every rank of the group holds its EP rank's experts of
every layer (the pipeline gather's stages share its EP rank). The engine keeps the group's ranks in
lockstep (generation/rollout.py), agreeing over a gloo twin of the group (`_host_group`).

With pipeline parallelism a stage holds only its layers, and decoding needs them all: the model is
resharded in memory (`PipelineGather`). Every rank keeps, next to its own stage's parameters (used
in place), a flat buffer per other stage of the same pipeline, filled by one broadcast per stage over
the PP group (the embedding comes with the first stage, the final norm and output head with the
last), and refilled after each optimizer step (`refresh`, from the policy's `sync_weights`). So each
rank holds its TP shard of every layer (never more than a TP shard), decodes alone, and the rank
split shares a call's requests over the data-parallel and the pipeline ranks together (the ranks
with the same TP rank).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state

from aligner_ext.architecture import architecture, rms_norm
from aligner_ext.adapters import LowRank
from aligner_ext.generation.decoder import (
    Decoder, ExpertExchange, ExpertWeights, LayerWeights, Projection, Shape, fused_buffer, split_adapter,
)
from aligner_ext.models.megatron.convert import EXPERT_NAME
from aligner_ext.models.megatron.lora import SUFFIX, ParallelLoRA
from aligner_ext.models.megatron.model import output_weight
from aligner_ext.models.megatron.parallel import partition_group


class MegatronGenerationModel(torch.nn.Module):
    """The GPTModel (a submodule, so `parameters()`, `eval()` and `train()` reach it) with the HF
    config and generation config the engine reads (EOS ids, architecture); with PP > 1 also the
    other stages' weights (`PipelineGather`)."""

    def __init__(self, core: torch.nn.Module, hf_config, generation_config):
        super().__init__()
        self.core = core
        self.config = hf_config
        self.generation_config = generation_config
        self.pipeline = PipelineGather(core) if parallel_state.get_pipeline_model_parallel_world_size() > 1 else None
        # the rank split shares requests over this group: the TP ranks of one replica decode together
        self.split_group = (parallel_state.get_data_parallel_group() if self.pipeline is None
                            else _same_tensor_rank_group())

    def refresh(self) -> None:
        """Bring the other stages' weights up to date after an optimizer step (nothing without PP)."""
        if self.pipeline is not None:
            self.pipeline.refresh()

    def weights(self) -> "StageWeights":
        """Every layer's parameters by name, in order, and the embedding, final norm and output head."""
        if self.pipeline is not None:
            return self.pipeline.weights()
        return stage_weights(self.core)

    def rollout_decoder(self, compile: bool = False, fuse_projections: bool = False, attention: str = "auto"):
        """The rollout engine's decoder over these shards (`fuse_projections` is moot: Megatron's
        q/k/v and gate/up matrices are fused already)."""
        return MegatronDecoder(self, compile=compile, attention=attention)


@dataclass
class StageWeights:
    """Named parameters of a stage's layers (in order) and of its ends, where it has them."""

    layers: list[dict[str, torch.Tensor]]
    ends: dict[str, torch.Tensor]  # embedding (first stage); final_norm, output (last stage)


def stage_weights(core) -> StageWeights:
    """This rank's stage of the GPTModel as `StageWeights` (its parameters themselves)."""
    ends = {}
    if core.pre_process:
        ends["embedding"] = core.embedding.word_embeddings.weight
    if core.post_process:
        ends["final_norm"] = core.decoder.final_layernorm.weight
        ends["output"] = output_weight(core)
    return StageWeights([in_stacking_order(dict(layer.named_parameters())) for layer in core.decoder.layers], ends)


def in_stacking_order(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's parameters with a mixture of experts' local experts' `linear_fc1` weights back to back
    in expert order, then their `linear_fc2` weights, after the layer's other parameters (in their
    order): `PipelineGather`'s flat buffers, laid out in this order, then hold each layer's stacked
    expert tensors as views (`MegatronDecoder._stacked`). A dense layer's order is unchanged."""
    experts = {name: EXPERT_NAME.fullmatch(name) for name in named}
    others = [name for name, match in experts.items() if match is None]
    stacked = sorted((name for name, match in experts.items() if match is not None),
                     key=lambda name: (experts[name].group(2), int(experts[name].group(1))))
    return {name: named[name] for name in others + stacked}


class PipelineGather:
    """Every stage's weights on every rank of a pipeline (module docstring): this stage's parameters
    in place, the others' in one flat buffer per stage, filled by a broadcast from that stage."""

    def __init__(self, core):
        self.group = parallel_state.get_pipeline_model_parallel_group()
        self.ranks = dist.get_process_group_ranks(self.group)
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self.own = stage_weights(core)
        first = self.own.layers[0]
        layer_shapes = [{name: tensor.shape for name, tensor in first.items()}] * len(self.own.layers)  # every stage alike
        hidden = core.config.hidden_size
        rows = core.vocab_size // parallel_state.get_tensor_model_parallel_world_size()  # this rank's vocabulary rows
        self.stages: list[StageWeights] = []
        self.flat: list[torch.Tensor | None] = []
        for stage in range(len(self.ranks)):
            if stage == self.stage:
                self.stages.append(self.own)
                self.flat.append(None)
                continue
            ends = {}
            if stage == 0:
                ends["embedding"] = (rows, hidden)
            if stage == len(self.ranks) - 1:
                ends.update(final_norm=(hidden,), output=(rows, hidden))
            shapes = [shape for named in layer_shapes for shape in named.values()] + list(ends.values())
            flat = torch.empty(sum(math.prod(shape) for shape in shapes), dtype=layer_dtype(first),
                               device=next(iter(first.values())).device)
            views = iter(_views(flat, shapes))
            self.stages.append(StageWeights([{name: next(views) for name in named} for named in layer_shapes],
                                            {name: next(views) for name in ends}))
            self.flat.append(flat)
        self.refresh()

    def refresh(self) -> None:
        """One broadcast per stage over the PP group: the owner sends its parameters, flattened."""
        for stage, rank in enumerate(self.ranks):
            if stage == self.stage:
                tensors = [t for named in self.own.layers for t in named.values()] + list(self.own.ends.values())
                dist.broadcast(torch.cat([t.detach().reshape(-1) for t in tensors]), src=rank, group=self.group)
            else:
                dist.broadcast(self.flat[stage], src=rank, group=self.group)

    def weights(self) -> StageWeights:
        ends = {}
        for stage in self.stages:
            ends.update(stage.ends)
        return StageWeights([named for stage in self.stages for named in stage.layers], ends)


def layer_dtype(named: dict[str, torch.Tensor]) -> torch.dtype:
    dtypes = {tensor.dtype for tensor in named.values()}
    if len(dtypes) != 1:
        raise ValueError(f"a layer's parameters have several dtypes {dtypes}: the pipeline gather sends one buffer")
    return dtypes.pop()


def _views(flat: torch.Tensor, shapes: list) -> list[torch.Tensor]:
    """Consecutive views of `flat` with these shapes."""
    views, start = [], 0
    for shape in shapes:
        size = math.prod(shape)
        views.append(flat[start : start + size].view(shape))
        start += size
    return views


def _host_group(group):
    """A gloo group of `group`'s ranks, for agreements on host values that must not wait for the
    device (`ExpertExchange.agree`)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, dist.get_process_group_ranks(group))
    return partition_group(list({tuple(ranks) for ranks in every}), backend="gloo")


def _same_tensor_rank_group():
    """The process group of the ranks with this rank's TP rank (data-parallel and pipeline ranks
    together)."""
    tensor_ranks = [None] * dist.get_world_size()
    dist.all_gather_object(tensor_ranks, parallel_state.get_tensor_model_parallel_rank())
    return partition_group([[rank for rank, value in enumerate(tensor_ranks) if value == tensor_rank]
                            for tensor_rank in set(tensor_ranks)])


# GPTModel parameter names of the norms, by `Architecture.norm_names`' roles
NORM_NAMES = {"input": "input_layernorm.weight", "pre_mlp": "pre_mlp_layernorm.weight",
              "post_attention": "self_attention.output_norm.weight", "post_mlp": "mlp.output_norm.weight"}


class MegatronDecoder(Decoder):
    """Prefill and decode over this rank's shards of a GPTModel (module docstring)."""

    def __init__(self, model: MegatronGenerationModel, compile: bool = False, attention: str = "auto"):
        self.model = model
        config = model.core.config
        self.architecture = architecture(model.config)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.group = parallel_state.get_tensor_model_parallel_group()
        self.tensor_parallel, self.tensor_rank = tp, parallel_state.get_tensor_model_parallel_rank()
        weights = model.weights()
        # a mixture of experts' stacked expert tensors that are copies (`_stacked`), with their sources
        self.expert_copies: list[tuple[torch.Tensor, list[torch.Tensor]]] = []
        # LoRA: every adapter has the same alpha / r
        self.lora_scale = next(
            (module.scale for module in model.core.modules() if isinstance(module, ParallelLoRA)), None)
        self.eps = config.layernorm_epsilon
        self.shape = Shape(config.num_attention_heads // tp, config.num_query_groups // tp, config.kv_channels,
                           self.eps, self.architecture.norm, self.architecture.activation, self.architecture.qk_norm,
                           tensor_parallel=tp, qkv_per_group=True)
        self.layers = [self._weights(named) for named in weights.layers]
        self.embedding = weights.ends["embedding"]  # [V_padded / TP, H]
        self.final_norm = weights.ends["final_norm"]
        self.output = weights.ends["output"]
        self.vocab_size = model.config.vocab_size
        if tp > 1:
            self.reduce = self._sum_over_group
            self.lockstep_group = _host_group(self.group)
        if self.architecture.experts is not None and parallel_state.get_expert_model_parallel_world_size() > 1:
            group = parallel_state.get_expert_model_parallel_group()
            self.exchange = ExpertExchange(group, _host_group(group), self.architecture.experts.count)
        super().__init__(model.config, compile, attention)

    def _weights(self, named: dict[str, torch.Tensor]) -> LayerWeights:
        """A layer's parameters by megatron-core's names (module docstring): the norms of the
        family's roles, q/k norms where it has them (a missing one is a KeyError, not a norm
        skipped)."""
        qkv = named["self_attention.linear_qkv.weight"]
        norms = {role: named[NORM_NAMES[role]] for role in self.architecture.norm_roles}
        qk_norms = ((named["self_attention.q_layernorm.weight"], named["self_attention.k_layernorm.weight"])
                    if self.architecture.qk_norm else (None, None))
        qkv_adapter = self._adapter(named, "self_attention.linear_qkv")
        qkv_projection = Projection((qkv,), (named.get("self_attention.linear_qkv.bias"),), (qkv.shape[0],),
                                    (qkv_adapter,) if qkv_adapter else ())
        attention = (norms.get("input"), qkv_projection, *qk_norms, named["self_attention.linear_proj.weight"], None,
                     norms.get("post_attention"), norms.get("pre_mlp"))
        if self.architecture.experts is not None:
            return LayerWeights(*attention, None, None, None, norms.get("post_mlp"),
                                self._adapter(named, "self_attention.linear_proj"), experts=self._experts(named))
        return LayerWeights(
            *attention, self._fc1(named, "mlp.linear_fc1"), named["mlp.linear_fc2.weight"], None, norms.get("post_mlp"),
            self._adapter(named, "self_attention.linear_proj"), self._adapter(named, "mlp.linear_fc2"))

    def _fc1(self, named: dict[str, torch.Tensor], linear: str) -> Projection:
        """A gated MLP's column-parallel `linear_fc1`: this rank's gate rows, then its up rows."""
        fc1, adapter = named[f"{linear}.weight"], self._adapter(named, linear)
        halves = (fc1.shape[0] // 2, fc1.shape[0] // 2)
        return Projection((fc1,), (None,), halves, split_adapter(adapter, halves) if adapter else ())

    def _experts(self, named: dict[str, torch.Tensor]) -> ExpertWeights:
        """megatron-core's MoE layer (`SequentialMLP`): the replicated router, the local experts'
        (all E at EP=1, E / EP under expert parallelism) `linear_fc1` [2I/TP, h] and `linear_fc2`
        [h, I/TP] stacked as transformers' [E, 2I/TP, h] and [E, h, I/TP] (this rank's columns of each
        expert: each expert's output, and so the weighted sum, is a partial sum over TP, summed with the
        layer's MLP output); Qwen2-MoE's shared expert (a TP-split gated MLP) and its replicated gate."""
        pieces = self.architecture.experts
        local = pieces.count // parallel_state.get_expert_model_parallel_world_size()
        fc = {linear: [named[f"mlp.experts.local_experts.{e}.{linear}.weight"] for e in range(local)]
              for linear in ("linear_fc1", "linear_fc2")}
        routed = (named["mlp.router.weight"], self._stacked(fc["linear_fc1"]), self._stacked(fc["linear_fc2"]),
                  pieces.top_k, pieces.normalize_top_k)
        if pieces.shared_ffn_size is None:
            return ExpertWeights(*routed)
        shared = "mlp.shared_experts."
        return ExpertWeights(*routed, self._fc1(named, f"{shared}linear_fc1"), named[f"{shared}linear_fc2.weight"],
                             self._adapter(named, f"{shared}linear_fc2"), named[f"{shared}gate_weight"])

    def _stacked(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The experts' matrices as one [E, rows, columns] tensor, which `torch._grouped_mm` needs: a view
        where they lie back to back in one storage (the other stages' layers, in `PipelineGather`'s flat
        buffers), else a copy (this stage's parameters, each its own tensor), refilled in place by
        `refresh` before every generate call (module docstring)."""
        buffer = fused_buffer(params)
        if buffer is not None:
            return buffer.view(len(params), *params[0].shape)
        with torch.inference_mode(False), torch.no_grad():
            copy = torch.stack([param.detach() for param in params])
        self.expert_copies.append((copy, params))
        return copy

    @torch.no_grad()
    def refresh(self) -> None:
        """Refill the stacked copies of this stage's experts from the parameters (in place: a captured
        decode step keeps their addresses)."""
        for copy, params in self.expert_copies:
            torch.stack(params, out=copy)

    def _adapter(self, named: dict[str, torch.Tensor], linear: str) -> LowRank | None:
        """The LoRA adapter of a layer's linear (its shards: the sums over the ranks of a row-parallel
        one's partial products are those of the base product), or None."""
        a = named.get(f"{linear}{SUFFIX}.a")
        return None if a is None else LowRank(a, named[f"{linear}{SUFFIX}.b"], self.lora_scale)

    @property
    def device(self) -> torch.device:
        return self.embedding.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.dtype

    def _sum_over_group(self, partial: torch.Tensor) -> None:
        dist.all_reduce(partial, group=self.group)

    def _embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        if self.reduce is None:
            return F.embedding(ids, self.embedding)
        # this rank's vocabulary rows: the ids outside them look up zeros, the sum fills them in
        rows = self.embedding.shape[0]
        local = ids - self.tensor_rank * rows
        outside = (local < 0) | (local >= rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.embedding).masked_fill(outside[..., None], 0.0)
        self.reduce(hidden)
        return hidden

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = rms_norm(hidden, self.final_norm, self.eps, self.shape.norm)
        logits = F.linear(normed, self.output)  # [b, V_padded / TP]
        if self.tensor_parallel > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tensor_parallel)]
            dist.all_gather(parts, logits, group=self.group)
            logits = torch.cat(parts, dim=-1)
        return logits[:, : self.vocab_size]
