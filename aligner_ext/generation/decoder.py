"""A decoder-only transformer run step by step over an external KV cache, on the policy's own modules.

`HFDecoder` drives a transformers Llama / Qwen2 / Qwen3 causal LM through its own submodules
(embedding, norms, q/k/v/o projections with their biases, Qwen3's q/k norms, the MLP, the head), so
it holds no copy of the weights and always computes with the policy's current parameters. Only the
attention and the cache are its own:

    SlotKVCache   one K and one V tensor per layer, [slots, kv_heads, length, head_dim]: a sequence
                  owns one slot for its whole life and its token t sits at position t
    prefill       new sequences, right-padded to the longest: causal attention over their own
                  tokens, K/V written to positions [0, length) of their slots
    decode        one new token for slots [0, rows): its K/V written at its position, attention over
                  the slot's positions up to it

Both attend through `attend` (torch SDPA, grouped-query heads without copies), the one place to
swap for another kernel. The engine calls only `new_cache`, `prefill` and `decode`, so a
tensor-parallel model plugs in as another decoder class with those three methods over its shards.
"""

from __future__ import annotations

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


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of q [b, H, s, d] over k, v [b, KVH, t, d] where `mask` [b, 1, s, t] is True."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])


class HFDecoder:
    """Prefill and decode steps of an HF Llama-family causal LM over a `SlotKVCache` (module docstring)."""

    def __init__(self, model):
        model_type = getattr(model.config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"the rollout engine runs {', '.join(SUPPORTED_MODEL_TYPES)} decoders; "
                             f"this model is {model_type!r} (use generator.engine=hf)")
        self.model = model
        self.base = model.get_decoder()
        first = self.base.layers[0].self_attn
        self.num_layers = len(self.base.layers)
        self.head_dim = first.head_dim
        self.num_heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        self.scale = first.scaling

    @property
    def device(self) -> torch.device:
        return self.base.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.base.embed_tokens.weight.dtype

    def new_cache(self, slots: int, length: int) -> SlotKVCache:
        return SlotKVCache(self.num_layers, slots, length, self.kv_heads, self.head_dim, self.dtype, self.device)

    def cache_bytes_per_slot_token(self) -> int:
        return SlotKVCache.bytes_per_slot_token(self.num_layers, self.kv_heads, self.head_dim, self.dtype)

    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor, cache: SlotKVCache) -> torch.Tensor:
        """Run right-padded prompts `ids` [b, s] (real lengths [b]) into `slots` [b]; float32 logits
        [b, V] of each prompt's last token."""
        width = ids.shape[1]
        positions = torch.arange(width, device=ids.device).expand(len(ids), width)
        causal = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril()
        real = positions < lengths[:, None]  # [b, s] keys that are prompt tokens
        mask = (causal[None] & real[:, None, :])[:, None]  # [b, 1, s, s]

        def write(layer: int, k: torch.Tensor, v: torch.Tensor):
            cache.keys[layer][slots, :, :width] = k
            cache.values[layer][slots, :, :width] = v
            return k, v

        hidden = self._layers(ids, positions, mask, write)
        last = hidden[torch.arange(len(ids), device=ids.device), lengths - 1]  # [b, h]
        return self._logits(last)

    def decode(self, ids: torch.Tensor, positions: torch.Tensor, cache: SlotKVCache) -> torch.Tensor:
        """One token per slot of [0, b): `ids`, `positions` [b]; float32 logits [b, V] of the next token."""
        rows = len(ids)
        visible = torch.arange(cache.length, device=ids.device)[None] <= positions[:, None]  # [b, t]
        mask = visible[:, None, None, :]  # [b, 1, 1, t]
        row_index = torch.arange(rows, device=ids.device)

        def write(layer: int, k: torch.Tensor, v: torch.Tensor):
            keys, values = cache.keys[layer], cache.values[layer]
            keys[row_index, :, positions] = k[:, :, 0]
            values[row_index, :, positions] = v[:, :, 0]
            return keys[:rows], values[:rows]

        hidden = self._layers(ids[:, None], positions[:, None], mask, write)
        return self._logits(hidden[:, 0])

    def _layers(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, write) -> torch.Tensor:
        """The decoder stack on `ids` [b, s] at `positions` [b, s]; `write(layer, k, v)` stores the new
        K/V and returns the K/V to attend over. Returns the final-normed hidden states [b, s, h]."""
        hidden = self.base.embed_tokens(ids)
        cos, sin = self.base.rotary_emb(hidden, positions)
        batch, width = ids.shape
        for index, layer in enumerate(self.base.layers):
            attn = layer.self_attn
            normed = layer.input_layernorm(hidden)
            q = attn.q_proj(normed).view(batch, width, self.num_heads, self.head_dim)
            k = attn.k_proj(normed).view(batch, width, self.kv_heads, self.head_dim)
            v = attn.v_proj(normed).view(batch, width, self.kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3 normalises queries and keys per head
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            keys, values = write(index, k, v.transpose(1, 2))
            out = attend(q, keys, values, mask, self.scale)  # [b, H, s, d]
            hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, width, -1))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.base.norm(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.get_output_embeddings()(hidden).float()
