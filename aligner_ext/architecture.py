"""What a decoder is made of, read from its HF config: the one place that knows the families.

Every family this library runs outside transformers (the Megatron backend, the rollout
engine) is a combination of the same pieces, and `Architecture` names the combination:

| piece | values (families) |
| --- | --- |
| norm formula | `llama`: normalise in float32, cast, scale (Llama, Qwen, Mistral, Phi-3, SmolLM3); `float32_scale`: scale in float32, then cast (OLMo 2/3); `gemma`: scale by (1 + w) in float32, then cast |
| norm placement | `pre` (most); `post`: norms on the attention's and MLP's outputs, none on their inputs (OLMo 2/3); `sandwich`: both (Gemma 3) |
| q/k norm | per head (Qwen3, Gemma 3); over the whole projection (OLMo 2/3) |
| MLP | SwiGLU (silu) or GeGLU (gelu, tanh approximation: Gemma 3) |
| embedding | scaled by sqrt(hidden) in the weights' dtype (Gemma 3) |
| attention scale | 1/sqrt(head_dim), or Gemma 3's `query_pre_attn_scalar` |
| per layer | RoPE table (one per layer type: Gemma 3's and OLMo 3's local and global bases) or none (SmolLM3's NoPE layers); sliding window or none |
| RoPE | transformers' own initialisation (`rope_tables`): every `rope_type` it defines, partial rotary |
| checkpoint | q/k/v and gate/up as separate matrices, or fused (Phi-3) |
| MLP kind | dense, or a mixture of experts (`Experts`: Qwen3-MoE, Qwen2-MoE with its gated shared expert): softmax top-k routing, the top k weights renormalised or not (`norm_topk_prob`), SwiGLU experts |

`support(hf_config)` says, per backend and engine, whether it runs the model and, if not, why, as
one line naming the family, the field and its value, and what runs it instead: the CLI prints it
and exits with status 2 before any weight loads (docs/models.md is generated from `FAMILIES`).

Decision (dynamic and LongRoPE scaling): transformers recomputes those frequencies from the longest
sequence of each batch, so its model changes with the batch. The tables here are the ones it sets at
load (short factors, the base frequencies), which are the ones it uses while every sequence stays
within `original_max_position_embeddings`; `support` warns when a run's sequences may not.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aligner_ext.errors import ConfigError


class UnsupportedModel(ConfigError):
    """A model this backend or engine cannot run; the message is the one line the CLI prints."""


@dataclass(frozen=True)
class Family:
    """How one `model_type` arranges the pieces (module docstring)."""

    name: str  # what users call it, for messages and docs
    norm: str = "llama"  # llama | float32_scale | gemma
    placement: str = "pre"  # pre | post | sandwich
    qk_norm: str | None = None  # None | head | projection
    qkv_bias: str = "attention_bias"  # always | attention_bias (the config field) | never
    fused_checkpoint: bool = False  # q/k/v and gate/up fused in the HF checkpoint (Phi-3)
    embedding_scaled: bool = False  # embeddings times sqrt(hidden) (Gemma)
    windows: str = "layer_types"  # layer_types: the layers typed sliding_attention | all: every layer when sliding_window is set
    no_rope_layers: bool = False  # `no_rope_layers[i] == 0` marks a layer without RoPE (SmolLM3)
    experts: bool = False  # the MLPs are mixtures of experts (`Experts`)


FAMILIES = {
    "llama": Family("Llama (2, 3, 3.1-3.3)", qkv_bias="never"),
    "mistral": Family("Mistral", qkv_bias="never", windows="all"),
    "ministral": Family("Ministral", qkv_bias="never"),
    "qwen2": Family("Qwen2 / Qwen2.5", qkv_bias="always"),
    "qwen3": Family("Qwen3", qk_norm="head"),
    "phi3": Family("Phi-3 / Phi-4-mini", qkv_bias="never", fused_checkpoint=True, windows="all"),
    "olmo2": Family("OLMo 2", norm="float32_scale", placement="post", qk_norm="projection"),
    "olmo3": Family("OLMo 3", norm="float32_scale", placement="post", qk_norm="projection"),
    "smollm3": Family("SmolLM3", no_rope_layers=True),
    "gemma3_text": Family("Gemma 3 (text)", norm="gemma", placement="sandwich", qk_norm="head",
                          embedding_scaled=True),
    "qwen3_moe": Family("Qwen3-MoE", qk_norm="head", experts=True),
    "qwen2_moe": Family("Qwen2-MoE", qkv_bias="always", experts=True),
}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}

# HF layer norm names per placement, by role: input (before attention), pre_mlp, post_attention
# (on the attention's output, before the residual add), post_mlp.
NORM_NAMES = {
    "pre": {"input": "input_layernorm", "pre_mlp": "post_attention_layernorm"},
    "post": {"post_attention": "post_attention_layernorm", "post_mlp": "post_feedforward_layernorm"},
    "sandwich": {"input": "input_layernorm", "post_attention": "post_attention_layernorm",
                 "pre_mlp": "pre_feedforward_layernorm", "post_mlp": "post_feedforward_layernorm"},
}


@dataclass(frozen=True)
class LayerPlan:
    """What differs between the layers of one model."""

    rope: str | None  # key of `rope_tables` (a layer type, or "default"); None: no RoPE in this layer
    window: int | None  # sliding window: a query sees itself and the window - 1 positions before it


@dataclass(frozen=True)
class Experts:
    """A mixture of experts in every layer's MLP: a router [count, hidden] scores each token, softmax
    over all experts in float32, the top `top_k` taken (and renormalised to sum to 1 where
    `normalize_top_k`); each chosen expert is a SwiGLU MLP of width `ffn_size`, and their outputs are
    summed with those weights. Qwen2-MoE adds a shared SwiGLU expert of width `shared_ffn_size` to
    every token, times sigmoid of its own gate [1, hidden]."""

    count: int
    top_k: int
    ffn_size: int
    normalize_top_k: bool
    shared_ffn_size: int | None


@dataclass(frozen=True)
class Architecture:
    """A decoder's pieces (module docstring), from `architecture(hf_config)`."""

    family: str  # model_type
    norm: str  # llama | float32_scale | gemma
    norm_names: dict  # role -> HF norm name (NORM_NAMES)
    qk_norm: str | None
    activation: str  # silu | gelu_tanh
    qkv_bias: bool
    fused_checkpoint: bool
    embedding_scale: float | None  # sqrt(hidden) for Gemma, None otherwise
    softmax_scale: float
    head_dim: int
    rotary_dim: int  # leading dimensions of each head that RoPE rotates (partial rotary)
    layers: tuple[LayerPlan, ...]
    experts: Experts | None = None  # None: dense MLPs

    @property
    def has_windows(self) -> bool:
        return any(layer.window is not None for layer in self.layers)

    @property
    def norm_roles(self) -> tuple[str, ...]:
        return tuple(self.norm_names)


def head_dim(hf_config) -> int:
    value = getattr(hf_config, "head_dim", None)
    return value if value else hf_config.hidden_size // hf_config.num_attention_heads


def _rope_parameters(hf_config) -> dict:
    # transformers >= 5 keeps theta and scaling in `rope_parameters` (per layer type where the model
    # has several); 4.x in rope_theta / rope_scaling
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {}, rope_theta=hf_config.rope_theta)
    return params


def _refuse(hf_config, field: str, value, what: str) -> UnsupportedModel:
    family = FAMILIES.get(hf_config.model_type)
    name = family.name if family else hf_config.model_type
    return UnsupportedModel(f"{name} ({hf_config.model_type}): {field}={value!r} is not supported {what}")


def _layer_types(hf_config) -> list[str] | None:
    return list(getattr(hf_config, "layer_types", None) or []) or None


def architecture(hf_config) -> Architecture:
    """The pieces of `hf_config`'s model; `UnsupportedModel` naming the first field no piece covers
    (the HF backend runs every model transformers runs, so the message says so)."""
    hf_only = "outside transformers (policy.backend=hf with generator.engine=hf runs it)"
    family = FAMILIES.get(hf_config.model_type)
    if family is None:
        known = ", ".join(FAMILIES)
        raise UnsupportedModel(f"model_type {hf_config.model_type!r} is not a family this library runs outside "
                               f"transformers ({known}); policy.backend=hf with generator.engine=hf runs it")
    activation = getattr(hf_config, "hidden_activation", None) or hf_config.hidden_act
    if activation not in ACTIVATIONS:
        raise _refuse(hf_config, "hidden_act", activation, hf_only)
    for field in ("mlp_bias", "attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention"):
        if getattr(hf_config, field, None):
            raise _refuse(hf_config, field, getattr(hf_config, field), hf_only)
    if family.qkv_bias == "never" and getattr(hf_config, "attention_bias", False):
        raise _refuse(hf_config, "attention_bias", True, hf_only + " (it also biases o_proj)")
    qkv_bias = family.qkv_bias == "always" or (family.qkv_bias == "attention_bias" and bool(hf_config.attention_bias))
    dim = head_dim(hf_config)
    scalar = getattr(hf_config, "query_pre_attn_scalar", None)
    tables = rope_tables(hf_config)
    rotary_dim = 2 * next(iter(tables.values()))[0].numel()
    return Architecture(
        family=hf_config.model_type, norm=family.norm, norm_names=NORM_NAMES[family.placement],
        qk_norm=family.qk_norm, activation=ACTIVATIONS[activation], qkv_bias=qkv_bias,
        fused_checkpoint=family.fused_checkpoint,
        embedding_scale=math.sqrt(hf_config.hidden_size) if family.embedding_scaled else None,
        softmax_scale=(scalar if scalar else dim) ** -0.5, head_dim=dim, rotary_dim=rotary_dim,
        layers=_layer_plans(hf_config, family, tables),
        experts=_experts(hf_config, hf_only) if family.experts else None,
    )


def _experts(hf_config, hf_only: str) -> Experts:
    """The mixture of experts of a Qwen3-MoE / Qwen2-MoE config; a refusal where some layers are dense
    (`decoder_sparse_step` other than 1, `mlp_only_layers`), which no piece covers yet."""
    if getattr(hf_config, "decoder_sparse_step", 1) != 1:
        raise _refuse(hf_config, "decoder_sparse_step", hf_config.decoder_sparse_step, hf_only)
    if getattr(hf_config, "mlp_only_layers", None):
        raise _refuse(hf_config, "mlp_only_layers", list(hf_config.mlp_only_layers), hf_only)
    shared = getattr(hf_config, "shared_expert_intermediate_size", None) or None
    return Experts(count=hf_config.num_experts, top_k=hf_config.num_experts_per_tok,
                   ffn_size=hf_config.moe_intermediate_size, normalize_top_k=bool(hf_config.norm_topk_prob),
                   shared_ffn_size=shared)


def _layer_plans(hf_config, family: Family, tables: dict) -> tuple[LayerPlan, ...]:
    types = _layer_types(hf_config)
    window = getattr(hf_config, "sliding_window", None)
    if getattr(hf_config, "use_sliding_window", True) is False:
        window = None  # Qwen2 / Qwen3 / SmolLM3 keep a window size they do not use unless this is set
    plans = []
    for index in range(hf_config.num_hidden_layers):
        layer_type = types[index] if types else "full_attention"
        if family.windows == "all":
            sliding = window is not None
        else:
            sliding = layer_type == "sliding_attention" and window is not None
        rope = layer_type if layer_type in tables else "default"
        if family.no_rope_layers and not hf_config.no_rope_layers[index]:
            rope = None
        plans.append(LayerPlan(rope=rope, window=int(window) if sliding else None))
    return tuple(plans)


def rotary_class(hf_config):
    """transformers' rotary embedding module of this model type (e.g. Gemma3RotaryEmbedding)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal_lm = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[hf_config.model_type])
    module = importlib.import_module(causal_lm.__module__)
    return getattr(module, causal_lm.__name__.replace("ForCausalLM", "RotaryEmbedding"))


def rope_tables(hf_config) -> dict[str, tuple[torch.Tensor, float]]:
    """{table key: (inverse frequencies [rotary_dim / 2] float32, attention scaling)}: "default", or
    one per layer type where the model keeps several. Computed by instantiating transformers' own
    rotary module of the model (its initialisation: every `rope_type`, partial rotary), on the CPU."""
    rotary = rotary_class(hf_config)(hf_config)
    per_type = getattr(rotary, "layer_types", None)
    if per_type:
        return {key: (getattr(rotary, f"{key}_inv_freq").float(), float(getattr(rotary, f"{key}_attention_scaling")))
                for key in per_type}
    return {"default": (rotary.inv_freq.float(), float(rotary.attention_scaling))}


def rope_types(hf_config) -> set[str]:
    """The `rope_type` of every table (for the support table and the long-context warning)."""
    params = _rope_parameters(hf_config)
    groups = params.values() if all(isinstance(value, dict) for value in params.values()) else [params]
    return {group.get("rope_type", group.get("type", "default")) if group else "default" for group in groups}


def rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [*positions.shape, rotary_dim] as transformers' rotary modules compute them: angles in
    float32, the halves repeated, times the attention scaling, cast to the model's dtype."""
    angles = positions.float()[..., None] * inv_freq.to(positions.device)
    table = torch.cat([angles, angles], dim=-1)
    return (table.cos() * attention_scaling).to(dtype), (table.sin() * attention_scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., d] rotated on its first cos.shape[-1] dimensions (rotate-half RoPE, partial where
    the table is narrower than the head), in x's dtype; cos and sin broadcast against x."""
    rotary = cos.shape[-1]
    rotated, passed = (x, None) if rotary == x.shape[-1] else (x[..., :rotary], x[..., rotary:])
    half = rotary // 2
    out = rotated * cos + torch.cat([-rotated[..., half:], rotated[..., :half]], dim=-1) * sin
    return out if passed is None else torch.cat([out, passed], dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, formula: str = "llama",
             mean_square: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x over its last dimension as the family's HF module computes it (module docstring).
    `mean_square` (float32, broadcasting against x): the mean of squares over the whole normalised
    dimension where x is one rank's shard of it (tensor parallelism); by default x's own."""
    dtype = x.dtype
    normed = x.float()
    if mean_square is None:
        mean_square = normed.pow(2).mean(-1, keepdim=True)
    normed = normed * torch.rsqrt(mean_square + eps)
    if formula == "llama":
        return weight * normed.to(dtype)
    if formula == "gemma":
        return (normed * (1.0 + weight.float())).to(dtype)
    return (weight.float() * normed).to(dtype)


def activation(name: str):
    """The gate's activation of a gated MLP: act(gate) * up."""
    if name == "gelu_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    return F.silu


def scale_embedding(hidden: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Gemma's scaled embedding: the scale rounded to the weights' dtype first, as transformers does."""
    if scale is None:
        return hidden
    # filled on the device, not copied from the host: the engine captures this in CUDA graphs
    return hidden * torch.full((), scale, dtype=torch.float32, device=hidden.device).to(hidden.dtype)
