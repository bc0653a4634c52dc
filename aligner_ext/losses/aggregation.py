"""Reduce a per-token loss [b, R] to the scalar of one micro-batch, divided by global counts.

Modes (x = per-token values, m = loss mask, N_tok / N_seq = counts of the whole optimizer step):

    token-mean            sum_{i,t} m*x / N_tok
        Every token weighs the same, so long responses dominate the step (DAPO, verl's default).
    seq-mean-token-mean   sum_i [ sum_t (m*x)_i / max(1, sum_t m_i) ] / N_seq
        Every sequence weighs the same and is length-normalised (the GRPO paper's formula).
    seq-mean-token-sum    sum_i sum_t (m*x)_i / N_seq
        Every sequence weighs the same, not length-normalised: a longer response gets a larger
        gradient. Up to a constant scale this is Dr.GRPO's normalisation (which divides by a fixed
        max length instead of N_seq).

All three are linear in x with weights that depend only on one row's mask and on the global
counts, so the sum over micro-batches equals the full-batch value (tests/unit/losses/
test_microbatch_invariance.py pins it). A global count of zero (nothing masked in the whole step)
is treated as 1: every masked sum is then 0, so the loss is 0 rather than NaN.
"""

from __future__ import annotations

from typing import Callable

import torch

from aligner_ext.losses.base import GlobalCounts


def _masked(per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # where, not multiply: a padded position holding inf/NaN must not leak into the sum
    return torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))


def _token_mean(per_token: torch.Tensor, mask: torch.Tensor, counts: GlobalCounts) -> torch.Tensor:
    return _masked(per_token, mask).sum() / max(1, counts.tokens)


def _seq_mean_token_mean(per_token: torch.Tensor, mask: torch.Tensor, counts: GlobalCounts) -> torch.Tensor:
    lengths = mask.sum(dim=1).clamp(min=1).to(per_token.dtype)
    return (_masked(per_token, mask).sum(dim=1) / lengths).sum() / max(1, counts.sequences)


def _seq_mean_token_sum(per_token: torch.Tensor, mask: torch.Tensor, counts: GlobalCounts) -> torch.Tensor:
    return _masked(per_token, mask).sum() / max(1, counts.sequences)


AGG_MODES: dict[str, Callable[[torch.Tensor, torch.Tensor, GlobalCounts], torch.Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
}


def check_agg_mode(mode: str) -> None:
    """Raise on an unknown aggregation mode, listing the known ones."""
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; known: {', '.join(AGG_MODES)}")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, counts: GlobalCounts) -> torch.Tensor:
    """Scalar loss of one micro-batch.

    Args:
        per_token: [b, R] float per-token values.
        mask: [b, R] bool, True where a token counts.
        mode: one of AGG_MODES (see the module docstring).
        counts: global counts of the optimizer step.
    """
    check_agg_mode(mode)
    if per_token.shape != mask.shape:
        raise ValueError(f"per-token values have shape {tuple(per_token.shape)}, mask {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
    return AGG_MODES[mode](per_token, mask, counts)
