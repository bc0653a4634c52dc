"""Token log-probs (and entropy) from hidden states, chunked over positions so a float32
[b, T, vocab] tensor never exists at once.

For a chunk of positions: logits = hidden @ W^T in the hidden dtype, upcast to float32, divided by
the sampling temperature, log_softmax, gather the targets; entropy = -sum_v p_v log p_v.

With autograd on, each chunk runs under `torch.utils.checkpoint` (non-reentrant): the forward keeps
only the chunk's inputs, and the backward recomputes that chunk's logits, so both passes hold at most
one chunk of [b, chunk, vocab] at a time (tests/unit/models/test_logprobs.py records every tensor
that either pass creates). Without autograd the chunks are simply computed one after another.

Decision: values are computed in float32, or float64 when the hidden states are float64 (tests use
that for exact gradient comparisons); the output has that dtype.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def logprobs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool, temperature: float = 1.0,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [b, T] of `targets` [b, T] under `logits` [b, T, V], and entropy [b, T] if asked.

    Logits are upcast to at least float32 before the temperature and the softmax. With
    `entropy_grad=False` the entropy is a metric without a graph (which would keep a [b, T, V] tensor).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    logp = torch.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = -(logp.exp() * logp).sum(dim=-1)
    return token_logp, entropy


def token_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int,
    with_entropy: bool,
    temperature: float = 1.0,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of `targets` given the final hidden states, `chunk_size` positions at a time.

    Args:
        hidden: [b, T, H] final hidden states; position t predicts targets[:, t].
        lm_head_weight: [V, H] output projection, same dtype as `hidden`.
        targets: [b, T] int64 token ids.
        chunk_size: positions per chunk (> 0); the last chunk may be shorter.
        with_entropy: also return the entropy of each position's distribution.
        temperature: the sampling temperature the logits are divided by.
        entropy_grad: whether the entropy carries gradient (False: a metric, no graph kept).

    Returns:
        logprobs [b, T] and entropy [b, T] (or None), float32 (float64 for float64 hidden states).
    """
    if chunk_size <= 0:
        raise ValueError(f"logprob chunk_size must be > 0, got {chunk_size}")
    if hidden.dtype != lm_head_weight.dtype:
        raise ValueError(f"hidden states are {hidden.dtype} but the lm head weight is {lm_head_weight.dtype}")
    if hidden.shape[:2] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree on [b, T]")

    def chunk_fn(hidden_chunk: torch.Tensor, weight: torch.Tensor, target_chunk: torch.Tensor):
        return logprobs_from_logits(hidden_chunk @ weight.T, target_chunk, with_entropy, temperature, entropy_grad)

    return over_chunks(chunk_fn, hidden, lm_head_weight, targets, chunk_size, with_entropy)


def over_chunks(chunk_fn, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int,
                with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Apply `chunk_fn(hidden_chunk, weight, target_chunk) -> (logprobs, entropy)` to `chunk_size`
    positions at a time and concatenate; under autograd each chunk is recomputed in the backward
    (activation checkpointing) instead of keeping its logits."""
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    parts_lp, parts_ent = [], []
    for start in range(0, max(hidden.shape[1], 1), chunk_size):  # no position: one empty chunk, graph kept
        args = (hidden[:, start : start + chunk_size], weight, targets[:, start : start + chunk_size])
        lp, ent = checkpoint(chunk_fn, *args, use_reentrant=False) if recompute else chunk_fn(*args)
        parts_lp.append(lp)
        parts_ent.append(ent)
    entropy = torch.cat(parts_ent, dim=1) if with_entropy else None
    return torch.cat(parts_lp, dim=1), entropy
