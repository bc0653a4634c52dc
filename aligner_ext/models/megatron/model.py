"""A megatron-core GPTModel built from an HF config (Llama, Qwen2, Qwen3), and its forward pass to
the final hidden states.

Architecture mapping (HF -> TransformerConfig): RMSNorm, SwiGLU MLP (`gated_linear_unit`, silu),
no linear biases except Qwen2's q/k/v biases (`add_qkv_bias`), Qwen3's per-head q/k RMSNorm
(`qk_layernorm`), grouped-query attention (`num_query_groups`), `head_dim` as `kv_channels`, RoPE
(non-interleaved, HF's rotate-half), tied embeddings as `share_embeddings_and_output_weights`.
Configurations outside this (RoPE scaling, sliding windows, MLP or output biases) are refused with
the field named, rather than built slightly wrong.

Layer spec: megatron-core's local spec with the core attention replaced by `SDPAttention`, which
applies RoPE (one fused kernel per q and k on GPUs) and calls torch's
`scaled_dot_product_attention` (causal, GQA) so GPUs get fused kernels without Transformer Engine
or flash-attn, and every norm (input, pre-MLP, final, Qwen3's q/k) replaced by
`RMSNorm`: HF's formula (normalise in float32, cast back, then scale), and its weight marked for
megatron-core's sequence-parallel gradient all-reduce; megatron-core's torch norm refuses sequence
parallelism, and its fused norms need Apex or Transformer Engine.

Sequence layout: our batches are left-padded, and attention takes no padding mask. `pack_rows`
therefore rolls each row left so the prompt starts at column 0: columns then equal HF's position
ids (counted over real tokens), every pad sits after the real tokens, and a plain causal mask keeps
real tokens from seeing any pad. `stage_forward` takes RoPE from the position ids rather than from
the column (megatron-core's own `_preprocess`), so a packed row (forward.pack_sequences), whose
later sequences start mid-row, is rotated per sequence too.

Vocabulary padding: the embedding and output layer are padded to a multiple of 128 rows
(megatron's usual `make_vocab_size_divisible_by`), independent of TP so a checkpoint reshards; the
padded rows are zero and masked out of every softmax (`logprobs.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from aligner_ext.models.attention import packed_causal_attention
from aligner_ext.models.kernels import compiled_on_cuda

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
VOCAB_DIVISIBLE_BY = 128


@dataclass
class SequenceLayout(PackedSeqParams):
    """megatron-core's `PackedSeqParams` (sbhd format; the sequences' cumulative lengths when a row
    holds several, else None) with the rotary tables of the tokens: `stage_forward` builds it once
    per forward and the layers hand it, untouched, to their core attention (`SDPAttention`)."""

    rotary_cos: torch.Tensor | None = None  # [s, 1, 1, d] in the model's dtype
    rotary_sin: torch.Tensor | None = None


@compiled_on_cuda
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [s, b, heads, d] rotated as HF's (and megatron-core's unfused) RoPE: x cos + rotate_half(x) sin,
    in x's dtype; one fused kernel forward and one backward on GPUs."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class SDPAttention(MegatronModule):
    """Core attention through torch SDPA: causal, grouped-query, no mask, no dropout.

    Takes query [s, b, heads, d] and key/value [s, b, groups, d] (this rank's heads) and returns
    [s, b, heads * d], the contract of megatron-core's `DotProductAttention`. RoPE is applied here
    (`apply_rotary`, from the `SequenceLayout`'s tables; `stage_forward` hands megatron-core no
    rotary embedding, whose own unfused chain recomputed cos and sin in every layer). A packed
    micro-batch (b = 1, several sequences end to end) carries the sequences' cumulative lengths:
    each sequence then attends to itself alone (`models/attention.py`).
    """

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        if config.attention_dropout != 0.0 or (attention_dropout or 0.0) != 0.0:
            raise ValueError("SDPAttention supports attention_dropout=0 only")
        self.softmax_scale = softmax_scale  # None: SDPA's 1/sqrt(d)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_mask is not None or attention_bias is not None:
            raise ValueError("SDPAttention is causal by construction; pass attention_mask=None and no bias")
        if not isinstance(packed_seq_params, SequenceLayout):
            raise ValueError("SDPAttention takes the SequenceLayout stage_forward builds (rotary tables, boundaries)")
        seq, batch, heads, dim = query.shape
        query = apply_rotary(query, packed_seq_params.rotary_cos, packed_seq_params.rotary_sin)
        key = apply_rotary(key, packed_seq_params.rotary_cos, packed_seq_params.rotary_sin)
        if packed_seq_params.cu_seqlens_q is not None:
            out = packed_causal_attention(query.squeeze(1), key.squeeze(1), value.squeeze(1),
                                          packed_seq_params.cu_seqlens_q, packed_seq_params.max_seqlen_q,
                                          self.softmax_scale)
            return out.reshape(seq, batch, heads * dim)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.shape[1] != heads
        )
        return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * dim)


class RMSNorm(torch.nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), normalised in float32 as HF's Llama/Qwen norms do."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **kwargs):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.eps = eps
        # megatron-core all-reduces the gradients of weights so marked over TP (finalize_model_grads)
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class LigerRMSNorm(RMSNorm):
    """`RMSNorm` through Liger-Kernel's Triton kernel (one pass forward, one backward; "llama" casting
    is HF's formula above). GPU only: `block_spec` picks it for `kernels="liger"`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        # in_place=False: megatron-core's residual path still reads the incoming gradient
        return LigerRMSNormFunction.apply(x, self.weight, self.eps, 0.0, "llama", False)


def head_dim(hf_config) -> int:
    value = getattr(hf_config, "head_dim", None)
    return value if value else hf_config.hidden_size // hf_config.num_attention_heads


def rope_theta(hf_config) -> float:
    """RoPE base of an HF config; refuses RoPE scaling, which the GPTModel here does not reproduce."""
    # transformers >= 5 keeps theta and scaling in `rope_parameters`; 4.x in rope_theta / rope_scaling
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    rope_type = params["rope_type"] if "rope_type" in params else "default"
    if rope_type != "default":
        raise ValueError(f"{hf_config.model_type}: RoPE scaling ({rope_type}) is not supported by the Megatron backend")
    return float(params["rope_theta"] if "rope_theta" in params else hf_config.rope_theta)


def qkv_bias(hf_config) -> bool:
    """Qwen2 always has q/k/v biases; Llama and Qwen3 have them when `attention_bias` is set."""
    if hf_config.model_type == "qwen2":
        return True
    if hf_config.model_type == "llama" and hf_config.attention_bias:
        raise ValueError("llama with attention_bias=True also biases o_proj, which is not supported")
    return bool(hf_config.attention_bias)


def check_hf_config(hf_config) -> None:
    """Raise, naming the field, for an HF config this backend cannot build exactly."""
    if hf_config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {hf_config.model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
    if getattr(hf_config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True is not supported")
    if hf_config.hidden_act != "silu":
        raise ValueError(f"hidden_act {hf_config.hidden_act!r} is not supported (silu only)")
    rope_theta(hf_config)


def padded_vocab_size(vocab_size: int, tensor_parallel: int) -> int:
    """Rows of the embedding / output layer: a multiple of 128 (and so of any TP size dividing 128)."""
    padded = math.ceil(vocab_size / VOCAB_DIVISIBLE_BY) * VOCAB_DIVISIBLE_BY
    if padded % tensor_parallel:
        raise ValueError(f"tensor_model_parallel_size={tensor_parallel} must divide the padded vocabulary {padded}")
    return padded


def transformer_config(hf_config, tensor_parallel: int, pipeline_parallel: int, dtype: torch.dtype,
                       sequence_parallel: bool = False, kernels: str = "none", recompute: bool = False
                       ) -> TransformerConfig:
    """The megatron-core TransformerConfig of an HF Llama / Qwen2 / Qwen3 config.

    `kernels="liger"` (GPUs) also turns on megatron-core's own fused SwiGLU (`bias_activation_fusion`,
    a torch.compile'd kernel); `block_spec` adds Liger's RMSNorm. `recompute` keeps only each layer's
    input in the forward and recomputes the layer in the backward (megatron-core's full, uniform
    activation recomputation, one layer per checkpoint): less memory, about a third more compute.
    """
    if kernels not in ("none", "liger"):
        raise ValueError(f"kernels must be none or liger (auto is resolved by the policy), got {kernels!r}")
    check_hf_config(hf_config)
    if hf_config.num_key_value_heads % tensor_parallel:
        raise ValueError(
            f"num_key_value_heads={hf_config.num_key_value_heads} must be divisible by "
            f"tensor_model_parallel_size={tensor_parallel}"
        )
    if hf_config.num_hidden_layers % pipeline_parallel:
        raise ValueError(
            f"num_hidden_layers={hf_config.num_hidden_layers} must be divisible by "
            f"pipeline_model_parallel_size={pipeline_parallel}"
        )
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=qkv_bias(hf_config),
        qk_layernorm=hf_config.model_type == "qwen3",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=kernels == "liger",
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
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
    )


def block_spec(config: TransformerConfig) -> TransformerBlockSubmodules:
    """This pipeline stage's layers: the local layer spec with `SDPAttention` and `RMSNorm` (Liger's
    where the config fuses kernels, `transformer_config(kernels="liger")`)."""
    norm = LigerRMSNorm if config.bias_activation_fusion else RMSNorm
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
    layer, attention = spec.submodules, spec.submodules.self_attention.submodules
    attention.core_attention = SDPAttention
    layer.input_layernorm = layer.pre_mlp_layernorm = norm
    if config.qk_layernorm:
        attention.q_layernorm = attention.k_layernorm = norm
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config), layer_norm=norm)


def build_gpt_model(hf_config, config: TransformerConfig, device: torch.device) -> GPTModel:
    """This rank's GPTModel (its pipeline stage, its tensor shards), weights not yet loaded."""
    model = GPTModel(
        config=config,
        transformer_layer_spec=block_spec(config),
        vocab_size=padded_vocab_size(hf_config.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(hf_config.tie_word_embeddings),
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
    )
    return model.to(device=device, dtype=config.params_dtype)


def output_weight(model: GPTModel) -> torch.Tensor:
    """[V_padded / TP, H] this rank's shard of the output projection (last pipeline stage only)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def stage_forward(model: GPTModel, input_ids: torch.Tensor, position_ids: torch.Tensor,
                  packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
    """Run this pipeline stage: [s, b, H] hidden states (after the final norm on the last stage).

    Args:
        input_ids: [b, s] int64 (`pack_rows` rows, or b = 1 packed sequences); read on the first stage only.
        position_ids: [b, s] int64, the same in every row: each token's position in its own sequence.
        packed_seq_params: the sequences' boundaries when the row holds several (`SDPAttention`).

    RoPE is taken from `position_ids` (megatron-core's own `_preprocess` would rotate by column,
    which a packed row's later sequences do not start at): cos and sin once per forward, in the
    model's dtype, applied in the core attention (`SequenceLayout`). On a later stage the input
    comes from `model.set_input_tensor` (the pipeline schedule sets it).
    """
    decoder_input = model.embedding(input_ids=input_ids, position_ids=position_ids) if model.pre_process else None
    positions = position_ids[0]
    angles = model.rotary_pos_emb(int(positions.max()) + 1)[positions]  # [s, 1, 1, d] float32
    boundaries = vars(packed_seq_params) if packed_seq_params is not None else {"qkv_format": "sbhd"}
    layout = SequenceLayout(**boundaries, rotary_cos=angles.cos().to(model.config.params_dtype),
                            rotary_sin=angles.sin().to(model.config.params_dtype))
    return model.decoder(hidden_states=decoder_input, attention_mask=None, rotary_pos_emb=None, packed_seq_params=layout)


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
