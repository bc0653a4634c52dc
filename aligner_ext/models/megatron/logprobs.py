"""Response log-probs and entropy over vocab-sharded logits: the shared fused head
(`models/logprobs.py`) on this rank's rows of the output projection.

Each TP rank holds rows [r*V/TP, (r+1)*V/TP) of the (padded) output projection. For a chunk of
tokens, rank r computes its logits z_r = h W_r^T / T and their statistics (max, sum of exponentials,
target logit, entropy's weighted sum; the target logit is zero on every rank but the one holding
the target), and `_combine_over_tp` all-reduces them: the global max, then the sums rescaled to it,
so every rank gets the global log-sum-exp and

    log p(y) = z[y] - log sum_v exp(z_v),   H = lse - sum_v p_v z_v

without the full vocabulary on any rank. Its backward gives each rank (onehot - softmax) on its own
slice, its rows' weight gradient and a partial dL/dh. `h` enters through
`enter_tensor_parallel_region`: an identity whose backward all-reduces the gradient over TP, or with
sequence parallelism megatron-core's all-gather of the sequence shards (reduce-scatter of the
gradient backward). Either way dL/dh is the sum of every rank's contribution, exactly once: the
gradient equals the unsharded computation's (tests/megatron pins it against the HF backend's
gradient, with and without sequence parallelism).

Decision: the identity is our own `_SumGradOverTP` rather than megatron-core's
`copy_to_tensor_model_parallel_region`, whose backward all-reduces `grad.contiguous()` and returns
the original: when the incoming gradient is not contiguous (a transpose, a gather by column) the
reduction lands in a discarded copy and the gradient silently stays per-rank.

Padded vocabulary rows (model.py) are left out of every sum, so the result equals the unpadded HF
computation. Every rank runs the same chunks in the same order and the collectives happen in the
forward only (the backward needs the saved lse), so they always match.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from aligner_ext.models.logprobs import Statistics, VocabSlice, fused_logprobs


def _combine_over_tp(statistics: Statistics) -> Statistics:
    """Every TP rank's (max, sum of exp, target logit, weighted sum) per token -> the global ones."""
    peak, total, target_logit, weighted = statistics
    group = parallel_state.get_tensor_model_parallel_group()
    shared_peak = peak.clone()
    dist.all_reduce(shared_peak, op=dist.ReduceOp.MAX, group=group)
    scale = torch.exp(peak - shared_peak)
    sums = torch.stack([total * scale, target_logit, weighted * scale])
    dist.all_reduce(sums, group=group)
    return shared_peak, sums[0], sums[1], sums[2]


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


def vocab_parallel_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, vocab_size: int,
                            chunk_size: int, with_entropy: bool, temperature: float = 1.0
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [N] float32 (and no-grad entropy) of `targets` [N] from final hidden states [N, H]
    (identical on every TP rank: the output of `enter_tensor_parallel_region`) and this rank's
    rows [V_padded / TP, H] of the output projection; `vocab_size` is the real vocabulary."""
    rows = weight.shape[0]
    offset = parallel_state.get_tensor_model_parallel_rank() * rows
    sharded = parallel_state.get_tensor_model_parallel_world_size() > 1
    vocab = VocabSlice(offset=offset, columns=max(0, min(rows, vocab_size - offset)),
                       combine=_combine_over_tp if sharded else None)
    return fused_logprobs(hidden, weight, targets, chunk_size, with_entropy, temperature, vocab)
