"""A megatron-core GPTModel built from an HF config of any family `aligner_ext/architecture.py`
describes (Llama 2/3 with any RoPE scaling, Mistral, Ministral, Qwen2/2.5, Qwen3, Phi-3/Phi-4-mini,
OLMo 2/3, SmolLM3, Gemma 3 text; the mixtures of experts Qwen3-MoE and Qwen2-MoE on megatron-core's
MoE layer, `moe_options`), and its forward pass to the final hidden states.

Architecture mapping: `architecture(hf_config)` names the family's pieces and refuses, in one line,
what no piece covers (MLP or output biases, logit soft-capping, another activation or model type),
rather than building it slightly wrong. `transformer_config` maps the pieces onto megatron-core's own
options where it has them: gated MLP (`gated_linear_unit`) with the family's activation (SwiGLU, or
Gemma's tanh GeGLU), no linear biases but q/k/v ones (`add_qkv_bias`), per-head q/k norms
(`qk_layernorm`), grouped-query attention (`num_query_groups`), `head_dim` as `kv_channels`, the
family's `softmax_scale`, tied embeddings as `share_embeddings_and_output_weights`. The rest is
written here, in megatron-core's local layer spec (`block_spec`):
- `RMSNorm`, every norm in the family's formula (`architecture.rms_norm`: llama, float32_scale,
  gemma), its weight marked for megatron-core's sequence-parallel gradient all-reduce
  (megatron-core's torch norm refuses sequence parallelism, its fused norms need Apex or Transformer
  Engine); Liger's kernel for the llama and gemma formulas (`kernels="liger"`), torch.compile's
  fused kernels for the others on GPUs (`fused_rms_norm`).
- Post-norms, which megatron-core has not: `PostNormSelfAttention` and `PostNormMLP` normalise their
  module's output (`output_norm`: after the row-parallel projection's reduction, before the residual
  add). OLMo 2/3 has them instead of the input and pre-MLP norms (IdentityOp there), Gemma 3 besides.
- `ProjectionRMSNorm`: OLMo's q (k) norm over the whole projection, of which a TP rank holds its
  heads (K/V groups): the mean of squares is summed over the TP group, the weight is TP-sharded.
- `SDPAttention`, the core attention: each layer's plan (`Architecture.layers`, by its global layer
  number): its RoPE table (partial rotary for Phi-3) or none (SmolLM3's NoPE layers), applied with the
  layer's q/k norms in one compiled call (`qk_prologue`, handed the norms by `FamilySelfAttention`),
  and its sliding window or none; then torch's `scaled_dot_product_attention` (causal or windowed,
  GQA) so GPUs get fused kernels without Transformer Engine or flash-attn.
- Gemma's embedding scale, in `stage_forward` after the embedding.

Sequence layout: our batches are left-padded, and attention takes no padding mask. `pack_rows`
therefore rolls each row left so the prompt starts at column 0: columns then equal HF's position
ids (counted over real tokens), every pad sits after the real tokens, and a plain causal (or
windowed) mask keeps real tokens from seeing any pad. `stage_forward` takes RoPE from the position
ids rather than from the column (megatron-core's own `_preprocess`), so a packed row
(forward.pack_sequences), whose later sequences start mid-row, is rotated per sequence too.

Vocabulary padding: the embedding and output layer are padded to a multiple of 128 rows
(megatron's usual `make_vocab_size_divisible_by`), independent of TP so a checkpoint reshards; the
padded rows are zero and masked out of every softmax (`logprobs.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint
from torch.distributed.nn.functional import all_reduce

from aligner_ext.architecture import (Architecture, Experts, activation, apply_rotary as rotate, architecture,
                                      rms_norm, rope_tables, rotary_cos_sin, scale_embedding)
from aligner_ext.models.attention import packed_causal_attention, sliding_window_mask
from aligner_ext.models.kernels import compiled_on_cuda
from aligner_ext.models.megatron.experts import GroupedExperts

VOCAB_DIVISIBLE_BY = 128


@dataclass
class ArchitectureConfig(TransformerConfig):
    """megatron-core's TransformerConfig with what its options do not say, for the layers to read:
    the family's pieces (norm formula, each layer's RoPE table and window) and the kernels choice."""

    architecture: Architecture | None = None
    kernels: str = "none"  # none | liger (Liger's RMSNorm for the llama and gemma formulas)


@dataclass
class SequenceLayout(PackedSeqParams):
    """megatron-core's `PackedSeqParams` (sbhd format; the sequences' cumulative lengths when a row
    holds several, else None) with what every layer shares: `stage_forward` builds it once per
    forward and the layers hand it, untouched, to their core attention (`SDPAttention`)."""

    rotary: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # table key -> cos, sin [s, 1, 1, rotary_dim]
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> [s, s] bool (unpacked rows, windows < s)


# The family's RMSNorm (optionally over a mean of squares summed over TP): one fused kernel forward and
# one backward on GPUs instead of eager's chain of float32 elementwise kernels and their saved copies
fused_rms_norm = compiled_on_cuda(rms_norm)


def qk_prologue(query: torch.Tensor, key: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                eps: float, formula: str, qk_norm: str | None, cos: torch.Tensor | None,
                sin: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """query [s, b, heads, d] and key [s, b, groups, d] through the layer's q/k norms (`qk_norm`: per
    head, over the whole projection, or None) and its RoPE (cos, sin [s, 1, 1, rotary_dim]; None: a
    layer without RoPE). One function, compiled on GPUs (`fused_qk_prologue`): one call forward and one
    backward per layer for what were up to four (two norms, two rotations), each costing the host its
    launch and autograd bookkeeping."""
    if qk_norm == "head":
        query, key = rms_norm(query, q_weight, eps, formula), rms_norm(key, k_weight, eps, formula)
    elif qk_norm == "projection":
        query = rms_norm(query.flatten(-2), q_weight, eps, formula).view(query.shape)
        key = rms_norm(key.flatten(-2), k_weight, eps, formula).view(key.shape)
    if cos is not None:
        query, key = rotate(query, cos, sin), rotate(key, cos, sin)
    return query, key


fused_qk_prologue = compiled_on_cuda(qk_prologue)


class SDPAttention(MegatronModule):
    """Core attention through torch SDPA: causal (or a sliding window), grouped-query, no dropout.

    Takes query [s, b, heads, d] and key/value [s, b, groups, d] (this rank's heads) and returns
    [s, b, heads * d], the contract of megatron-core's `DotProductAttention`. Its layer's plan comes
    from the config's Architecture by `layer_number` (megatron-core's, 1-based and global across
    pipeline stages). RoPE is applied here from the `SequenceLayout`'s table of the layer
    (`stage_forward` hands megatron-core no rotary embedding, whose own unfused chain recomputed cos
    and sin in every layer), together with the layer's q/k norms where `FamilySelfAttention` hands
    them over (`qk_norms`: their modules keep the weights and pass their input through), in one
    compiled call (`qk_prologue`). A packed micro-batch (b = 1, several sequences end to end) carries
    the sequences' cumulative lengths: each sequence then attends to itself alone (`models/attention.py`).
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        if config.attention_dropout != 0.0 or (attention_dropout or 0.0) != 0.0:
            raise ValueError("SDPAttention supports attention_dropout=0 only")
        self.softmax_scale = softmax_scale
        plan = config.architecture.layers[layer_number - 1]
        self.rope, self.window = plan.rope, plan.window
        self.qk_norms: tuple[RMSNorm, RMSNorm] | None = None  # set by FamilySelfAttention (a tuple: no submodules)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("SDPAttention is causal by construction; pass attention_mask=None and no bias")
        if not isinstance(packed_seq_params, SequenceLayout):
            raise ValueError("SDPAttention takes the SequenceLayout stage_forward builds (rotary tables, boundaries)")
        seq, batch, heads, dim = query.shape
        cos, sin = packed_seq_params.rotary[self.rope] if self.rope is not None else (None, None)
        if self.qk_norms is not None or cos is not None:
            q_norm, k_norm = self.qk_norms or (None, None)
            normed = q_norm is not None
            query, key = fused_qk_prologue(
                query, key, q_norm.weight if normed else None, k_norm.weight if normed else None,
                q_norm.eps if normed else 0.0, self.config.architecture.norm,
                self.config.architecture.qk_norm if normed else None, cos, sin)
        if packed_seq_params.cu_seqlens_q is not None:
            out = packed_causal_attention(query.squeeze(1), key.squeeze(1), value.squeeze(1),
                                          packed_seq_params.cu_seqlens_q, packed_seq_params.max_seqlen_q,
                                          self.softmax_scale, self.window)
            return out.reshape(seq, batch, heads * dim)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        mask = packed_seq_params.window_masks.get(self.window)  # None: the window spans the row, plain causal
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=self.softmax_scale,
                                             enable_gqa=k.shape[1] != heads)
        return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * dim)


class RMSNorm(torch.nn.Module):
    """The family's RMSNorm (`architecture.rms_norm` in the config's formula: llama, float32_scale or
    gemma), its weight marked for megatron-core's sequence-parallel gradient all-reduce."""

    tensor_parallel_axes: dict[str, int] = {}  # replicated over TP

    def __init__(self, config: ArchitectureConfig, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.eps = eps
        self.formula = config.architecture.norm
        # megatron-core all-reduces the gradients of weights so marked over TP (finalize_model_grads)
        self.weight.sequence_parallel = config.sequence_parallel
        # a q/k norm that the core attention applies (`FamilySelfAttention`): its call passes x through
        self.applied_by_core_attention = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.applied_by_core_attention:
            return x
        return fused_rms_norm(x, self.weight, self.eps, self.formula)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The weight as a distributed checkpoint stores it (megatron-core's MLP asks each of its
        children for this, `PostNormMLP`'s norm included)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, self.tensor_parallel_axes, sharded_offsets,
            tp_group=parallel_state.get_tensor_model_parallel_group(), dp_cp_group=metadata["dp_cp_group"])


class LigerRMSNorm(RMSNorm):
    """`RMSNorm` through Liger-Kernel's Triton kernel (one pass forward, one backward), for the two
    formulas whose Liger modes its own transformers patches use (Llama's and Gemma's, checked against
    float32 on an H100: scripts/bench/liger_families.py at 4e17684): "llama" normalises in float32 and scales in
    the input's dtype, "gemma" does everything in float32 with the weight offset by 1. GPU only:
    `norm_module` picks it for `kernels="liger"`. (OLMo's float32 scaling would be mode "gemma" with
    offset 0: no faster at 1B in docs/benchmarks.md's measurement, so not taken.)"""

    CASTING = {"llama": (0.0, "llama"), "gemma": (1.0, "gemma")}  # formula -> (offset, casting mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        if self.applied_by_core_attention:
            return x
        offset, casting = self.CASTING[self.formula]
        # in_place=False: megatron-core's residual path still reads the incoming gradient
        return LigerRMSNormFunction.apply(x, self.weight, self.eps, offset, casting, False)


class ProjectionRMSNorm(RMSNorm):
    """OLMo's q (or k) norm: one RMSNorm over the whole projection [heads * head_dim], of which this
    TP rank holds its own heads (its K/V groups for k), [s, b, local heads, d].

    The mean of squares is all-reduced over the TP group, in the backward too: every rank's
    normalised heads depend on every rank's squares (megatron-core's `reduce_from_tensor_model_parallel_region`
    passes the gradient back unreduced, right only where what follows is replicated). The weight is
    this rank's slice in the per-group order (`convert.py`), marked TP-sharded (gradient norm,
    distributed checkpoint) and not for the sequence-parallel all-reduce: its gradient is whole on
    each rank."""

    tensor_parallel_axes = {"weight": 0}

    def __init__(self, config: ArchitectureConfig, hidden_size: int, eps: float = 1e-6, projection: str = "query",
                 **kwargs):
        heads = config.num_attention_heads if projection == "query" else config.num_query_groups
        tensor_parallel = config.tensor_model_parallel_size
        super().__init__(config, heads * config.kv_channels // tensor_parallel, eps)
        self.projection_size = heads * config.kv_channels
        self.tensor_parallel = tensor_parallel
        self.weight.sequence_parallel = False
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.applied_by_core_attention:  # TP = 1 (FamilySelfAttention): the formula's own mean, in qk_prologue
            return x
        flat = x.flatten(-2)
        mean_square = None  # TP = 1: the whole projection is here, the formula's own mean
        if self.tensor_parallel > 1:
            square_sum = all_reduce(flat.float().pow(2).sum(-1, keepdim=True),
                                    group=parallel_state.get_tensor_model_parallel_group())
            mean_square = square_sum / self.projection_size
        return fused_rms_norm(flat, self.weight, self.eps, self.formula, mean_square).view_as(x)


def norm_module(config: ArchitectureConfig) -> type[RMSNorm]:
    """Liger's kernel where the config asks for it and it computes the family's formula."""
    return LigerRMSNorm if config.kernels == "liger" and config.architecture.norm in LigerRMSNorm.CASTING else RMSNorm


class FamilySelfAttention(SelfAttention):
    """megatron-core's SelfAttention whose q/k norms the core attention applies, fused with RoPE
    (`SDPAttention`, `qk_prologue`): the norm modules keep their weights (checkpoints, gradients,
    the rollout engine read them there) and pass their input through. OLMo's norms over the whole
    projection under tensor parallelism stay in their modules, which sum the squares over the ranks."""

    def __init__(self, config: ArchitectureConfig, submodules, layer_number: int, **kwargs):
        super().__init__(config, submodules, layer_number, **kwargs)
        if config.architecture.qk_norm == "projection":  # not in the spec: megatron-core 0.19 builds the
            # spec's q/k norms only under `qk_layernorm`, whose TP all-reduce these TP-sharded weights must not get
            self.q_layernorm = ProjectionRMSNorm(config, config.kv_channels, config.layernorm_epsilon, "query")
            self.k_layernorm = ProjectionRMSNorm(config, config.kv_channels, config.layernorm_epsilon, "key")
        norms = (self.q_layernorm, self.k_layernorm)
        if all(isinstance(norm, RMSNorm) for norm in norms) and not (
                config.architecture.qk_norm == "projection" and config.tensor_model_parallel_size > 1):
            for norm in norms:
                norm.applied_by_core_attention = True
            self.core_attention.qk_norms = norms


class PostNormSelfAttention(FamilySelfAttention):
    """`FamilySelfAttention` with its output normalised (`output_norm`, HF's post-attention norm of
    OLMo 2/3 and Gemma 3): after the row-parallel projection's reduction (its sequence shard under
    sequence parallelism), before the residual add."""

    def __init__(self, config: ArchitectureConfig, submodules, layer_number: int, **kwargs):
        super().__init__(config, submodules, layer_number, **kwargs)
        self.output_norm = norm_module(config)(config, config.hidden_size, config.layernorm_epsilon)

    def forward(self, *args, **kwargs):
        output, bias = super().forward(*args, **kwargs)  # bias: None, no linear biases
        return self.output_norm(output), bias


class PostNormMLP(MLP):
    """megatron-core's MLP (the local spec's linears) with its output normalised (`output_norm`, HF's
    post-feedforward norm of OLMo 2/3 and Gemma 3), before the residual add. The layer spec names
    the class itself, not a ModuleSpec: TransformerLayer hands its TP group to `MLP` specs alone and
    logs a warning per layer for any other spec."""

    def __init__(self, config: ArchitectureConfig, **kwargs):
        super().__init__(config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                         ffn_hidden_size=config.ffn_hidden_size)
        self.output_norm = norm_module(config)(config, config.hidden_size, config.layernorm_epsilon)

    def forward(self, hidden_states, **kwargs):
        output, bias = super().forward(hidden_states, **kwargs)
        return self.output_norm(output), bias


def padded_vocab_size(vocab_size: int, tensor_parallel: int) -> int:
    """Rows of the embedding / output layer: a multiple of 128 (and so of any TP size dividing 128)."""
    padded = math.ceil(vocab_size / VOCAB_DIVISIBLE_BY) * VOCAB_DIVISIBLE_BY
    if padded % tensor_parallel:
        raise ValueError(f"tensor_model_parallel_size={tensor_parallel} must divide the padded vocabulary {padded}")
    return padded


def transformer_config(hf_config, tensor_parallel: int, pipeline_parallel: int, dtype: torch.dtype,
                       sequence_parallel: bool = False, kernels: str = "none", recompute: bool = False,
                       expert_parallel: int = 1, aux_loss_coef: float = 0.0) -> ArchitectureConfig:
    """The megatron-core TransformerConfig of an HF config of any family `architecture()` covers
    (`UnsupportedModel`, one line, for the others).

    `kernels="liger"` (GPUs) turns on megatron-core's own fused gated activation
    (`bias_activation_fusion`, a torch.compile'd kernel forward and backward: SwiGLU, or Gemma's tanh
    GeGLU), and `block_spec` Liger's RMSNorm where it computes the family's formula (llama, gemma);
    the other norms (OLMo's) are compiled on GPUs either way. `recompute` keeps only each layer's
    input in the forward and recomputes the layer in the backward (megatron-core's full, uniform
    activation recomputation, one layer per checkpoint): less memory, about a third more compute.
    `expert_parallel` (EP) splits a mixture of experts' experts over EP data-parallel ranks, each
    holding count / EP of them (megatron-core's `num_local_experts`); a dense model is refused at EP > 1.
    `aux_loss_coef`: a mixture of experts' load-balancing loss coefficient (`moe_options`).
    """
    if kernels not in ("none", "liger"):
        raise ValueError(f"kernels must be none or liger (auto is resolved by the policy), got {kernels!r}")
    arch = architecture(hf_config)
    fused_activation = kernels == "liger"  # megatron-core's compiled SwiGLU / GeGLU kernels
    if hf_config.num_key_value_heads % tensor_parallel:
        raise ValueError(
            f"num_key_value_heads={hf_config.num_key_value_heads} must be divisible by "
            f"tensor_model_parallel_size={tensor_parallel}"
        )
    if arch.experts is not None and tensor_parallel > 1 and not sequence_parallel:
        raise ValueError(f"a mixture of experts at tensor_model_parallel_size={tensor_parallel} trains with sequence "
                         "parallelism only (megatron-core's MoE layer refuses it without): policy.sequence_parallel=true")
    if expert_parallel > 1 and arch.experts is None:
        raise ValueError(f"expert_model_parallel_size={expert_parallel} splits a mixture of experts' experts: "
                         f"{hf_config.model_type} is a dense model, run it at policy.expert_model_parallel_size=1")
    if arch.experts is not None and arch.experts.count % expert_parallel:
        raise ValueError(f"expert_model_parallel_size={expert_parallel} must divide num_experts={arch.experts.count}")
    if hf_config.num_hidden_layers % pipeline_parallel:
        raise ValueError(
            f"num_hidden_layers={hf_config.num_hidden_layers} must be divisible by "
            f"pipeline_model_parallel_size={pipeline_parallel}"
        )
    return ArchitectureConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        # megatron-core fuses the gated activation where `bias_activation_fusion` is set: SwiGLU for
        # F.silu, GeGLU for F.gelu, whose fused kernel is the tanh approximation Gemma's MLP uses (its
        # unfused path would take F.gelu as the exact erf GELU: F.gelu is named only when fused)
        activation_func=F.gelu if fused_activation and arch.activation == "gelu_tanh" else activation(arch.activation),
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        # per-head norms: replicated weights whose gradients megatron-core all-reduces over TP by this
        # flag; OLMo's TP-sharded projection norms must not be (block_spec adds them without it)
        qk_layernorm=arch.qk_norm == "head",
        softmax_scale=arch.softmax_scale,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=fused_activation,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        expert_model_parallel_size=expert_parallel,
        sequence_parallel=sequence_parallel and tensor_parallel > 1,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=not torch.cuda.is_available(),
        # the weights are then overwritten from the HF checkpoint (convert.py), but megatron-core
        # only marks parameters as TP-sharded (`tensor_model_parallel`) while initialising them,
        # and the gradient norm and checkpoint sharding read that mark
        perform_initialization=True,
        calculate_per_token_loss=True,  # losses arrive normalised by global counts: schedules must not rescale
        recompute_granularity="full" if recompute else None,
        recompute_method="uniform" if recompute else None,
        recompute_num_layers=1 if recompute else None,
        architecture=arch,
        kernels=kernels,
        **(moe_options(arch.experts, aux_loss_coef) if arch.experts else {}),
    )


def moe_options(experts: Experts, aux_loss_coef: float = 0.0) -> dict:
    """megatron-core's MoE options for the family's mixture of experts (`architecture.Experts`).
    Routing: softmax over all experts then the top k (`moe_router_pre_softmax`) where the weights are
    not renormalised; where they are, the top k of the logits then a softmax over those k, which is the
    same (softmax is monotone, and its renormalised top k is the softmax of the top-k logits). The
    router's logits are computed in the model's dtype, as transformers computes them
    (`moe_router_dtype` unset). No token dropping: each token goes to its k experts
    (`moe_expert_capacity_factor` unset). `aux_loss_coef` > 0: megatron-core's load-balancing loss
    (`aux_loss`, per layer), weighted per micro-batch by moe.py's `Routers`; else none."""
    return dict(
        num_moe_experts=experts.count,
        moe_router_topk=experts.top_k,
        moe_ffn_hidden_size=experts.ffn_size,
        moe_router_pre_softmax=not experts.normalize_top_k,
        moe_router_load_balancing_type="aux_loss" if aux_loss_coef > 0 else "none",
        moe_aux_loss_coeff=aux_loss_coef,
        moe_token_dispatcher_type="allgather",  # the alltoall one needs CUDA streams (no CPU tests)
        moe_shared_expert_intermediate_size=experts.shared_ffn_size,
        moe_shared_expert_gate=experts.shared_ffn_size is not None,
        moe_shared_expert_overlap=False,
        moe_grouped_gemm=False,
    )


def block_spec(config: ArchitectureConfig) -> TransformerBlockSubmodules:
    """This pipeline stage's layers: the local layer spec with `SDPAttention`, the family's norms by
    role (`Architecture.norm_names`; IdentityOp where it has none), its per-head q/k norms and post-norms
    (OLMo's q/k norms over the projection: `FamilySelfAttention`)."""
    arch = config.architecture
    norm = norm_module(config)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    attention.core_attention = SDPAttention
    layer.input_layernorm = norm if "input" in arch.norm_names else IdentityOp
    layer.pre_mlp_layernorm = norm if "pre_mlp" in arch.norm_names else IdentityOp
    if arch.qk_norm == "head":
        attention.q_layernorm = attention.k_layernorm = norm
    layer.self_attention.module = PostNormSelfAttention if "post_attention" in arch.norm_names else FamilySelfAttention
    if arch.experts is not None:  # megatron-core's MoE layer (router, token dispatch) with grouped expert products
        layer.mlp = get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts=arch.experts.count)
        moe = layer.mlp.keywords["submodules"]
        moe.experts = partial(GroupedExperts, submodules=moe.experts.keywords["submodules"])
    elif "post_mlp" in arch.norm_names:
        layer.mlp = PostNormMLP
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=norm)


def build_gpt_model(hf_config, config: ArchitectureConfig, device: torch.device) -> GPTModel:
    """This rank's GPTModel (its pipeline stage, its tensor shards), weights not yet loaded; with the
    inverse frequencies of its RoPE tables on `device` (`rotary_tables`, read by `stage_forward`)."""
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(config),
        vocab_size=padded_vocab_size(hf_config.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        position_embedding_type="none",  # RoPE per layer's table: SDPAttention
    )
    model = model.to(device=device, dtype=config.params_dtype)
    model.rotary_tables = {key: (inv_freq.to(device), scaling) for key, (inv_freq, scaling) in rope_tables(hf_config).items()}
    return model


def output_weight(model: GPTModel) -> torch.Tensor:
    """[V_padded / TP, H] this rank's shard of the output projection (last pipeline stage only)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def stage_forward(model: GPTModel, input_ids: torch.Tensor, position_ids: torch.Tensor,
                  packed_seq_params: PackedSeqParams | None = None, padding_mask: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Run this pipeline stage: [s, b, H] hidden states (after the final norm on the last stage).

    Args:
        input_ids: [b, s] int64 (`pack_rows` rows, or b = 1 packed sequences); read on the first stage only.
        position_ids: [b, s] int64, the same in every row: each token's position in its own sequence.
        packed_seq_params: the sequences' boundaries when the row holds several (`SDPAttention`).
        padding_mask: [b, s] bool, True on pads (this rank's sequence shard under sequence
            parallelism): megatron-core's MoE layers leave them out of the load-balancing loss.

    RoPE is taken from `position_ids` (megatron-core's own `_preprocess` would rotate by column,
    which a packed row's later sequences do not start at): cos and sin of every RoPE table once per
    forward, in the model's dtype, and the sliding-window masks of unpacked rows, handed to each
    layer's core attention (`SequenceLayout`). Gemma's embeddings are scaled here. On a later stage
    the input comes from `model.set_input_tensor` (the pipeline schedule sets it).
    """
    config = model.config
    decoder_input = None
    if model.pre_process:
        decoder_input = scale_embedding(model.embedding(input_ids=input_ids, position_ids=position_ids),
                                        config.architecture.embedding_scale)
    positions = position_ids[0]
    rotary = {}
    for key, (inv_freq, scaling) in model.rotary_tables.items():
        cos, sin = rotary_cos_sin(positions, inv_freq, scaling, config.params_dtype)
        rotary[key] = (cos[:, None, None], sin[:, None, None])  # [s, 1, 1, rotary_dim]
    window_masks = {}
    if packed_seq_params is None:  # packed rows take the window per sequence (models/attention.py)
        width = positions.shape[0]
        windows = {layer.window for layer in config.architecture.layers if layer.window is not None}
        window_masks = {window: sliding_window_mask(width, window, positions.device) for window in windows
                        if window < width}
    boundaries = vars(packed_seq_params) if packed_seq_params is not None else {"qkv_format": "sbhd"}
    layout = SequenceLayout(**boundaries, rotary=rotary, window_masks=window_masks)
    return model.decoder(hidden_states=decoder_input, attention_mask=None, rotary_pos_emb=None, packed_seq_params=layout,
                         padding_mask=padding_mask)


def pack_rows(prompt_mask: torch.Tensor, input_ids: torch.Tensor, pad_token_id: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Roll left-padded rows so each prompt starts at column 0 (see the module docstring).

    Args:
        prompt_mask: [b, P] bool, True on real prompt tokens (left-padded, at least one per row).
        input_ids: [b, P+R] prompt then right-padded response.
        pad_token_id: written into the columns freed by the roll.

    Returns:
        ids [b, P+R], position_ids [b, P+R] (= column), and response_columns [b, R]: the column
        whose hidden state predicts response token t, i.e. prompt_length - 1 + t.
    """
    prompt_lengths = prompt_mask.sum(dim=1)
    if bool((prompt_lengths == 0).any()):
        raise ValueError(f"rows {torch.nonzero(prompt_lengths == 0).flatten().tolist()} have an empty prompt")
    width, prompt_width = input_ids.shape[1], prompt_mask.shape[1]
    columns = torch.arange(width, device=input_ids.device)
    pads = (prompt_width - prompt_lengths).unsqueeze(1)
    source = columns + pads
    ids = torch.where(source < width, input_ids.gather(1, source.clamp(max=width - 1)), pad_token_id)
    response_columns = prompt_lengths.unsqueeze(1) - 1 + torch.arange(width - prompt_width, device=input_ids.device)
    return ids, columns.expand_as(ids).contiguous(), response_columns
