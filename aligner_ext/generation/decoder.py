"""A decoder-only transformer run step by step over an external KV cache, on the policy's own weights.

`HFDecoder` computes a transformers Llama / Qwen2 / Qwen3 causal LM with its own functions over
the policy's parameter tensors (referenced, never copied: after an optimizer step it computes with
the new values). The math is the transformers modules', op for op (RMSNorm in float32, rotary
embedding by the model's own `rotary_emb`, SwiGLU MLP), which the CPU tests check token for token
against the HF engine. Only the attention and the cache differ:

    SlotKVCache   one K and one V tensor per layer, [slots, kv_heads, length, head_dim]: a sequence
                  owns one slot for its whole life and its token t sits at position t
    prefill       new sequences, right-padded to the longest: causal attention over their own
                  tokens, K/V written to positions [0, length) of their slots
    decode        one new token for slots [0, rows): its K/V written at its position, attention over
                  the first `attended` positions of the slot, masked after its own position

A layer is two pure functions of tensors (`attention_inputs`, `layer_output`) with the attention
between them, so `compile=True` hands the two to torch.compile once for all layers (every layer
passes tensors of the same shapes) and the decode step, captured in a CUDA graph by the engine,
runs fused kernels. Attention goes through `attend_prefill` / `attend_decode` (torch SDPA), the one
place to swap for another kernel. The engine calls only `new_cache`, `prefill` and `decode`, so a
tensor-parallel model plugs in as another decoder class with those three methods over its shards.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


class SlotKVCache:
    """Per-layer K/V tensors [slots, kv_heads, length, head_dim], allocated once per generate call."""

    def __init__(self, num_layers: int, slots: int, length: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (slots, kv_heads, length, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = length

    @staticmethod
    def bytes_per_slot_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def copy_prefix(self, source: int, targets: list[int], length: int) -> None:
        """Give `targets` the first `length` positions of slot `source` (a shared prompt)."""
        index = torch.tensor(targets, device=self.keys[0].device)
        for cache in (*self.keys, *self.values):
            cache[index, :, :length] = cache[source, :, :length]


class LayerWeights(NamedTuple):
    """One decoder layer's parameter tensors (the module's own; None where the model has none)."""

    input_norm: torch.Tensor
    q: torch.Tensor
    q_bias: torch.Tensor | None
    k: torch.Tensor
    k_bias: torch.Tensor | None
    v: torch.Tensor
    v_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3 normalises queries and keys per head
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate: torch.Tensor
    gate_bias: torch.Tensor | None
    up: torch.Tensor
    up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


class Shape(NamedTuple):
    """The constants a layer's functions need."""

    num_heads: int
    kv_heads: int
    head_dim: int
    eps: float


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama/Qwen RMSNorm: normalise in float32, scale in the input's dtype."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def attention_inputs(hidden: torch.Tensor, w: LayerWeights, cos: torch.Tensor, sin: torch.Tensor,
                     shape: Shape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [b, H, s, d], k and v [b, KVH, s, d] of `hidden` [b, s, h], rotated to their positions."""
    batch, width, _ = hidden.shape
    normed = rms_norm(hidden, w.input_norm, shape.eps)
    q = F.linear(normed, w.q, w.q_bias).view(batch, width, shape.num_heads, shape.head_dim)
    k = F.linear(normed, w.k, w.k_bias).view(batch, width, shape.kv_heads, shape.head_dim)
    v = F.linear(normed, w.v, w.v_bias).view(batch, width, shape.kv_heads, shape.head_dim)
    if w.q_norm is not None:
        q, k = rms_norm(q, w.q_norm, shape.eps), rms_norm(k, w.k_norm, shape.eps)
    q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, v.transpose(1, 2)


def layer_output(hidden: torch.Tensor, attended: torch.Tensor, w: LayerWeights, shape: Shape) -> torch.Tensor:
    """The layer's output from its input `hidden` [b, s, h] and the attention output [b, H, s, d]."""
    batch, width, _ = hidden.shape
    hidden = hidden + F.linear(attended.transpose(1, 2).reshape(batch, width, -1), w.o, w.o_bias)
    normed = rms_norm(hidden, w.post_norm, shape.eps)
    gate = F.silu(F.linear(normed, w.gate, w.gate_bias))
    return hidden + F.linear(gate * F.linear(normed, w.up, w.up_bias), w.down, w.down_bias)


def attend_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of q [b, H, s, d] over k, v [b, KVH, s, d] where `mask` [b, 1, s, s] is True."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def attend_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """One query per sequence, q [b, H, 1, d], over keys, values [b, KVH, t, d] with the additive
    mask `bias` [b, t] (0 where visible, -inf elsewhere). The H / KVH query heads sharing a K/V head become that head's query rows, so
    the kernel reads each K/V head once and nothing is expanded (head h uses K/V head h // (H / KVH),
    as transformers' repeat_kv)."""
    batch, heads, _, dim = q.shape
    grouped = q.reshape(batch, keys.shape[1], heads // keys.shape[1], dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=bias[:, None, None, :], scale=scale)
    return out.reshape(batch, heads, 1, dim)


class HFDecoder:
    """Prefill and decode steps of an HF Llama-family causal LM over a `SlotKVCache` (module docstring)."""

    def __init__(self, model, compile: bool = False):
        config = model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"the rollout engine runs {', '.join(SUPPORTED_MODEL_TYPES)} decoders; "
                             f"this model is {model_type!r} (use generator.engine=hf)")
        if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "use_sliding_window", False):
            raise ValueError("the rollout engine runs SwiGLU decoders without sliding-window attention "
                             f"(hidden_act={config.hidden_act!r}); use generator.engine=hf")
        self.model = model
        self.base = model.get_decoder()
        first = self.base.layers[0]
        self.num_layers = len(self.base.layers)
        self.shape = Shape(config.num_attention_heads, config.num_key_value_heads, first.self_attn.head_dim,
                           first.input_layernorm.variance_epsilon)
        self.scale = first.self_attn.scaling
        self.layers = [self._weights(layer) for layer in self.base.layers]
        self.head = model.get_output_embeddings()
        # The decode step's layer functions; prefill keeps the eager ones (its shapes vary per call).
        self.decode_inputs, self.decode_output = attention_inputs, layer_output
        if compile:
            self.decode_inputs = torch.compile(attention_inputs, dynamic=True)
            self.decode_output = torch.compile(layer_output, dynamic=True)

    @staticmethod
    def _weights(layer) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        return LayerWeights(
            layer.input_layernorm.weight, attn.q_proj.weight, attn.q_proj.bias, attn.k_proj.weight, attn.k_proj.bias,
            attn.v_proj.weight, attn.v_proj.bias, None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight, attn.o_proj.weight, attn.o_proj.bias,
            layer.post_attention_layernorm.weight, mlp.gate_proj.weight, mlp.gate_proj.bias, mlp.up_proj.weight,
            mlp.up_proj.bias, mlp.down_proj.weight, mlp.down_proj.bias)

    @property
    def device(self) -> torch.device:
        return self.base.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.base.embed_tokens.weight.dtype

    @property
    def vocab_size(self) -> int:
        return self.head.weight.shape[0]

    def new_cache(self, slots: int, length: int) -> SlotKVCache:
        return SlotKVCache(self.num_layers, slots, length, self.shape.kv_heads, self.shape.head_dim, self.dtype,
                           self.device)

    def cache_bytes_per_slot_token(self) -> int:
        return SlotKVCache.bytes_per_slot_token(self.num_layers, self.shape.kv_heads, self.shape.head_dim, self.dtype)

    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, cache: SlotKVCache) -> torch.Tensor:
        """Run right-padded prompts `ids` [b, s] (real lengths [b]) into `slots` [b]; float32 logits
        [b, V] of each prompt's last token."""
        width = ids.shape[1]
        positions = torch.arange(width, device=ids.device).expand(len(ids), width)
        causal = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril()
        real = positions < lengths[:, None]  # [b, s] keys that are prompt tokens
        mask = (causal[None] & real[:, None, :])[:, None]  # [b, 1, s, s]
        hidden, (cos, sin) = self._embed(ids, positions)
        for index, w in enumerate(self.layers):
            q, k, v = attention_inputs(hidden, w, cos, sin, self.shape)
            cache.keys[index][slots, :, :width] = k
            cache.values[index][slots, :, :width] = v
            hidden = layer_output(hidden, attend_prefill(q, k, v, mask, self.scale), w, self.shape)
        last = hidden[torch.arange(len(ids), device=ids.device), lengths - 1]  # [b, h]
        return self._logits(last)

    def decode(self, ids: torch.Tensor, positions: torch.Tensor, cache: SlotKVCache, attended: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """One token per slot of [0, b): `ids`, `positions` [b], every position < `attended`; float32
        logits [b, V] of the next token (written into `out` when given)."""
        rows, kv_heads, dim = len(ids), self.shape.kv_heads, self.shape.head_dim
        visible = torch.arange(attended, device=ids.device)[None] <= positions[:, None]  # [b, attended]
        # One additive mask for every layer (a boolean one is converted by SDPA in each call).
        bias = torch.zeros(visible.shape, dtype=self.dtype, device=ids.device).masked_fill_(~visible, float("-inf"))
        # Row of each (slot, kv head) at its position in a layer's cache seen as [slots * kv_heads * length, d].
        heads = torch.arange(rows * kv_heads, device=ids.device).view(rows, kv_heads)
        cache_rows = (heads * cache.length + positions[:, None]).view(-1)
        hidden, (cos, sin) = self._embed(ids[:, None], positions[:, None])
        for index, w in enumerate(self.layers):
            q, k, v = self.decode_inputs(hidden, w, cos, sin, self.shape)
            keys, values = cache.keys[index], cache.values[index]
            keys.view(-1, dim).index_copy_(0, cache_rows, k.reshape(-1, dim))
            values.view(-1, dim).index_copy_(0, cache_rows, v.reshape(-1, dim))
            attended_out = attend_decode(q, keys[:rows, :, :attended], values[:rows, :, :attended], bias, self.scale)
            hidden = self.decode_output(hidden, attended_out, w, self.shape)
        return self._logits(hidden[:, 0], out)

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor):
        """Token embeddings [b, s, h] and the model's rotary (cos, sin) at `positions` [b, s]."""
        hidden = self.base.embed_tokens(ids)
        return hidden, self.base.rotary_emb(hidden, positions)

    def _logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and output head; float32 logits."""
        logits = self.head(self.base.norm(hidden))
        return logits.float() if out is None else out.copy_(logits)
