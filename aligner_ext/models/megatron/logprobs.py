"""Log-probs and entropy of response tokens over vocab-sharded logits, chunked over positions.

Each TP rank holds rows [r*V/TP, (r+1)*V/TP) of the (padded) output projection. For a chunk of
positions, rank r computes its logits z_r = h W_r^T / temperature in float32, and:

    log p(y) = z[y] - log sum_v exp(z_v)

through megatron-core's `vocab_parallel_cross_entropy` (all-reduces of the max, of the target
logit and of the sum of exponentials; its backward gives each rank (softmax - onehot) on its own
slice), negated. The full vocabulary is never gathered on one rank. `h` enters through
`enter_tensor_parallel_region`: an identity whose backward all-reduces the gradient over TP, or
with sequence parallelism megatron-core's all-gather of the sequence shards (reduce-scatter of the
gradient backward). Either way dL/dh is the sum of every rank's contribution, exactly once: the
gradient equals the unsharded computation's (tests/megatron pins it against the HF backend's
gradient, with and without sequence parallelism).

Decision: the identity is our own `_SumGradOverTP` rather than megatron-core's
`copy_to_tensor_model_parallel_region`, whose backward all-reduces `grad.contiguous()` and returns
the original: when the incoming gradient is not contiguous (a transpose, a gather by column) the
reduction lands in a discarded copy and the gradient silently stays per-rank.

Entropy H = log Z - sum_v p_v z_v = m + log(sum_v e^{z_v - m}) - (sum_v e^{z_v - m} z_v) / (sum_v e^{z_v - m})
with m the global max; three all-reduces. Decision: entropy is a metric, computed without
gradient (detached), as the HF backend's loss uses it for metrics only.

Padded vocabulary rows (model.py) get logit -inf-like (the dtype's lowest finite value) so they
carry zero probability and the result equals the unpadded HF computation.

As in `models/logprobs.py`, with autograd on each chunk runs under non-reentrant activation
checkpointing, so forward and backward hold one [b, chunk, V/TP] float32 block at a time. Every
rank runs the same chunks in the same order, so the collectives (also in the recomputation) match.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region, vocab_parallel_cross_entropy

from aligner_ext.models.logprobs import over_chunks


def _mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits [.., V/TP] of this rank with the columns at global index >= vocab_size pushed to the lowest value."""
    local = logits.shape[-1]
    real = vocab_size - parallel_state.get_tensor_model_parallel_rank() * local
    if real >= local:
        return logits
    columns = torch.arange(local, device=logits.device)
    return logits.masked_fill(columns >= max(real, 0), torch.finfo(logits.dtype).min)


@torch.no_grad()
def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy [...] of softmax(logits) where `logits` [..., V/TP] is this rank's slice (float32)."""
    group = parallel_state.get_tensor_model_parallel_group()
    peak = logits.max(dim=-1).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - peak.unsqueeze(-1)
    weights = shifted.exp()
    sums = torch.stack([weights.sum(dim=-1), (weights * shifted).sum(dim=-1)])
    dist.all_reduce(sums, group=group)
    return sums[0].log() - sums[1] / sums[0]


class _SumGradOverTP(torch.autograd.Function):
    """Identity forward; the backward all-reduces (a contiguous copy of) the gradient over TP."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        return grad


def enter_tensor_parallel_region(hidden: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
    """Final hidden states [s, b, H] (or [s/TP, b, H] sequence-parallel) -> [s, b, H] on every TP rank,
    with the backward summing the ranks' gradients once."""
    if sequence_parallel:
        return gather_from_sequence_parallel_region(hidden)
    return _SumGradOverTP.apply(hidden)


def vocab_parallel_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    chunk_size: int,
    with_entropy: bool,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of `targets` from final hidden states and this rank's output-layer shard.

    Args:
        hidden: [b, T, H] final hidden states (identical on every TP rank) taken from the output of
            `enter_tensor_parallel_region`; position t predicts targets[:, t].
        weight: [V_padded / TP, H] this rank's rows of the output projection, dtype of `hidden`.
        targets: [b, T] int64 token ids < vocab_size.
        vocab_size: the real vocabulary size; rows at and beyond it are padding.
        chunk_size: positions per chunk (> 0).
        with_entropy: also return the (no-grad) entropy of each position's distribution.
        temperature: the sampling temperature the logits are divided by (> 0).

    Returns:
        logprobs [b, T] float32 (with grad when autograd is on) and entropy [b, T] float32 or None.
    """
    if chunk_size <= 0 or temperature <= 0:
        raise ValueError(f"chunk_size ({chunk_size}) and temperature ({temperature}) must be > 0")
    if hidden.shape[:2] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree on [b, T]")

    def chunk_fn(hidden_chunk: torch.Tensor, shard: torch.Tensor, target_chunk: torch.Tensor):
        logits = _mask_padded_vocab((hidden_chunk @ shard.T).float() / temperature, vocab_size)
        entropy = vocab_parallel_entropy(logits) if with_entropy else None
        # vocab_parallel_cross_entropy shifts its input in place: entropy is computed first
        return -vocab_parallel_cross_entropy(logits, target_chunk), entropy

    return over_chunks(chunk_fn, hidden, weight, targets, chunk_size, with_entropy)
