"""Causal attention over packed sequences: several sequences laid end to end in one row, each
attending only to its own earlier tokens (a block-diagonal causal mask), so a packed micro-batch
computes nothing on pads; with a sliding window (Mistral, Phi-3, Gemma 3's local layers...) only to
the last `window` of them, itself included, as transformers' sliding window (`sliding_window_mask`).

On a GPU, `torch.nn.attention.varlen.varlen_attn` (FlashAttention over cumulative lengths; torch >=
2.10); where its signature has no `enable_gqa` (torch 2.11), key/value heads are repeated to the
query heads first. Elsewhere (the CPU tests) each sequence goes through SDPA on its own slice, the
same mathematics. Measured (docs/benchmarks.md, scripts/bench/attention_varlen.py at 4e17684): on the H100 the
varlen kernel over 16 packed sequences costs about what SDPA costs on the same rows padded, and the
per-sequence loop 20x more, so the loop is the CPU path only.

Both backends use it: the Megatron backend from its core attention (`megatron/model.py`), the HF
backend through transformers' attention interface (`hf_packed_attention`, which registers it
under its own implementation name and switches a model to it for one packed forward).
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.nn.functional as F


@functools.cache
def _varlen_kernel():
    """(varlen_attn, whether it takes enable_gqa), or None where torch has no varlen attention."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def sliding_window_mask(length: int, window: int, device: torch.device) -> torch.Tensor:
    """[length, length] bool, True where query i sees key j: j <= i and j > i - window (transformers'
    sliding window: the query and the window - 1 tokens before it)."""
    columns = torch.arange(length, device=device)
    distance = columns[:, None] - columns[None, :]
    return (distance >= 0) & (distance < window)


def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                            max_seqlen: int, scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Attention of packed sequences.

    Args:
        query: [T, heads, d]; key, value: [T, kv_heads, d] (kv_heads divides heads).
        cu_seqlens: [N + 1] int32 sequence boundaries (0, len_0, len_0 + len_1, ..., T).
        max_seqlen: the longest sequence (the kernel's tile bound).
        scale: softmax scale; None is 1 / sqrt(d).
        window: sliding window (`sliding_window_mask`); None attends to every earlier token.

    Returns:
        [T, heads, d].
    """
    if window is not None and window >= max_seqlen:
        window = None  # it excludes no key of any sequence: the plain causal kernel, faster than a windowed one
    kernel = _varlen_kernel()
    if query.is_cuda and kernel is not None:
        varlen_attn, takes_gqa = kernel
        extra = {}
        if key.shape[1] != query.shape[1]:
            if takes_gqa:
                extra["enable_gqa"] = True
            else:
                group = query.shape[1] // key.shape[1]
                key, value = (t.repeat_interleave(group, dim=1) for t in (key, value))
        # FlashAttention's window counts the keys before the query: window - 1 of them (checked on an
        # H100 against the per-sequence path below, windows 1, 4, 16, 100)
        return varlen_attn(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale=scale,
                           window_size=(-1 if window is None else window - 1, 0), **extra)
    bounds = cu_seqlens.tolist()
    parts = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))  # [heads, n, d]
        mask = sliding_window_mask(end - start, window, q.device) if window is not None and window < end - start else None
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                             enable_gqa=k.shape[0] != q.shape[0])
        parts.append(out.transpose(0, 1))
    return torch.cat(parts)


HF_PACKED_ATTENTION = "aligner_packed"


def _hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                  **kwargs):
    """transformers' attention-interface contract over one packed row: query [1, heads, S, d],
    key / value [1, kv_heads, S, d], the boundaries in kwargs (`cu_seq_lens_q`, `max_length_q`,
    as transformers names them), the layer's sliding window (None: none) -> ([1, S, heads, d], no weights)."""
    if query.shape[0] != 1 or "cu_seq_lens_q" not in kwargs:
        raise ValueError("packed attention takes one row with its cu_seq_lens_q / max_length_q")
    out = packed_causal_attention(*(t[0].transpose(0, 1) for t in (query, key, value)), kwargs["cu_seq_lens_q"],
                                  kwargs["max_length_q"], scaling, sliding_window)
    return out.unsqueeze(0), None


@functools.cache
def _register_hf_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(HF_PACKED_ATTENTION, _hf_attention)
    AttentionMaskInterface.register(HF_PACKED_ATTENTION, lambda *args, **kwargs: None)  # the boundaries are the mask


@contextlib.contextmanager
def hf_packed_attention(model):
    """Within the block, `model`'s attention layers attend within each packed sequence (pass the
    boundaries as `cu_seq_lens_q` / `max_length_q` to its forward); its own implementation (SDPA for
    generation and padded rows) is back afterwards."""
    _register_hf_attention()
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = HF_PACKED_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous
