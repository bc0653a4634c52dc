"""Token log-probs (and entropy) from final hidden states: one fused, chunked head for both backends.

For N tokens with final hidden states h [N, H], the output projection W [V, H] and targets y [N]:

    z = h W^T / T                                  (T: the sampling temperature)
    log p(y) = z_y - lse(z),   lse(z) = m + log sum_v exp(z_v - m),   m = max_v z_v
    entropy  = lse(z) - sum_v p_v z_v               (a metric: no gradient)
    dL/dz_v  = g (1[v = y] - exp(z_v - lse)) / T    (g = dL/dlog p(y); needs only lse)
    dL/dh = (dL/dz) W,   dL/dW = (dL/dz)^T h

`fused_logprobs` runs this `chunk_size` tokens at a time inside one autograd function. The forward
keeps the inputs and lse per token, never logits; the backward recomputes a chunk's logits (one
matrix product), turns them into their gradient in the hidden dtype, and accumulates the weight's
gradient in place into one buffer. Memory holds one [chunk, V] block of logits (and of their
gradient) at a time, and each chunk's logits are read twice in the hidden dtype (statistics, then
gradient), where log_softmax, gather and their backward in float32 made about a dozen passes.

The per-element work is two functions, `chunk_statistics` and `logit_gradient`: on CUDA compiled
by torch.compile (each becomes fused kernels), on the CPU run as they are. Values are computed in
float32, or float64 when the hidden states are float64 (tests use that for exact comparisons).

Vocabulary-parallel heads (the Megatron backend's TP ranks, megatron/logprobs.py): W is this rank's
rows [offset, offset + V_local) of the (padded) projection. A `VocabSlice` says which of its columns
are real (the padding rows are left out of every sum) and how to combine the per-rank statistics
(all-reduces of the max, of the rescaled sums and of the target logit, which only the rank holding
the target has), so every rank gets the global lse. Each rank's backward then gives its rows' weight
gradient and a partial dL/dh, which the caller sums over TP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from aligner_ext.models.kernels import compiled_on_cuda

Statistics = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # max, sum of exp, target logit, sum of exp * z


@compiled_on_cuda
def chunk_statistics(logits: torch.Tensor, targets: torch.Tensor, columns: int, inv_temperature: float,
                     with_entropy: bool) -> Statistics:
    """Per-row statistics of z = logits[:, :columns] * inv_temperature in float32 (float64 for float64):
    the max m, sum_v exp(z_v - m), z at the target (0 where the target is not among these columns)
    and, with entropy, sum_v exp(z_v - m) z_v (else zeros)."""
    z = logits[:, :columns].to(torch.promote_types(logits.dtype, torch.float32)) * inv_temperature
    if columns == 0:  # a TP rank whose rows are all padding: nothing to add to any sum
        nothing = z.new_zeros(z.shape[0])
        return nothing - torch.inf, nothing, nothing, nothing
    peak = z.amax(dim=-1)
    weights = torch.exp(z - peak.unsqueeze(-1))
    here = (targets >= 0) & (targets < columns)
    target_logit = torch.where(here, z.gather(1, targets.clamp(0, columns - 1).unsqueeze(-1)).squeeze(-1), 0.0)
    weighted = (weights * z).sum(dim=-1) if with_entropy else torch.zeros_like(peak)
    return peak, weights.sum(dim=-1), target_logit, weighted


@compiled_on_cuda
def logit_gradient(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor, columns: int,
                   inv_temperature: float) -> torch.Tensor:
    """dL/dlogits [c, V_local] in the logits' dtype: grad * (1[v = y] - softmax_v) / T on the real
    columns, zero on the padding ones."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) * inv_temperature
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    probs = torch.exp(z - lse.unsqueeze(-1))
    onehot = (vocab == targets.unsqueeze(-1)).to(probs.dtype)
    result = grad.unsqueeze(-1) * (onehot - probs) * inv_temperature
    return torch.where(vocab < columns, result, 0.0).to(logits.dtype)


@dataclass(frozen=True)
class VocabSlice:
    """Which vocabulary this head's rows cover: rows [offset, offset + columns) hold real tokens (rows
    beyond `columns` are padding); `combine` merges every slice's statistics (identity for the whole
    vocabulary)."""

    offset: int = 0
    columns: int | None = None  # None: every row of the weight is real
    combine: Callable[[Statistics], Statistics] | None = None


class _FusedHead(torch.autograd.Function):
    """(log-probs [N], entropy [N]) of `targets` from `hidden` [N, H] and `weight` [V_local, H]."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size, with_entropy, vocab):
        columns = weight.shape[0] if vocab.columns is None else vocab.columns
        local = targets - vocab.offset
        parts = []
        for start in range(0, hidden.shape[0], chunk_size):
            logits = hidden[start : start + chunk_size] @ weight.T
            part = chunk_statistics(logits, local[start : start + chunk_size], columns, 1.0 / temperature, with_entropy)
            parts.append(torch.stack(part))
        width = torch.promote_types(hidden.dtype, torch.float32)
        stats = torch.cat(parts, dim=1) if parts else hidden.new_zeros((4, 0), dtype=width)
        peak, total, target_logit, weighted = vocab.combine(tuple(stats)) if vocab.combine else tuple(stats)
        lse = peak + torch.log(total)
        entropy = lse - weighted / total if with_entropy else lse.new_zeros(0)
        ctx.save_for_backward(hidden, weight, local, lse)
        ctx.settings = (temperature, chunk_size, columns)
        ctx.mark_non_differentiable(entropy)
        return target_logit - lse, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, local, lse = ctx.saved_tensors
        temperature, chunk_size, columns = ctx.settings
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = hidden[rows] @ weight.T
            grad_logits = logit_gradient(logits, lse[rows], local[rows], grad_logprobs[rows], columns, 1.0 / temperature)
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[rows])
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.T, hidden[rows])
        return grad_hidden, grad_weight, None, None, None, None, None


def fused_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int,
                   with_entropy: bool, temperature: float = 1.0, vocab: VocabSlice = VocabSlice()
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of `targets` given final hidden states, `chunk_size` tokens at a time.

    Args:
        hidden: [N, H] final hidden states; row i predicts targets[i].
        weight: [V_local, H] output projection (or this rank's slice, `vocab`), dtype of `hidden`.
        targets: [N] int64 token ids (global ids when the weight is a slice).
        chunk_size: tokens per chunk (> 0); bounds the [chunk, V_local] logits held at once.
        with_entropy: also return each token's entropy (no gradient).
        temperature: the sampling temperature the logits are divided by (> 0).
        vocab: the slice of the vocabulary the weight's rows cover (default: all of it).

    Returns:
        log-probs [N] float32 (float64 for float64 inputs), with gradient to `hidden` and `weight`
        when autograd is on, and entropy [N] or None.
    """
    if chunk_size <= 0:
        raise ValueError(f"logprob chunk_size must be > 0, got {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden states are {hidden.dtype} but the lm head weight is {weight.dtype}")
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [N, H] and targets {tuple(targets.shape)} [N]")
    logprobs, entropy = _FusedHead.apply(hidden, weight, targets, temperature, chunk_size, with_entropy, vocab)
    return logprobs, entropy if with_entropy else None
