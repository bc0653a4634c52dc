"""Statistics of per-sample scores within groups given by explicit ids (prompt groups, MTPO's answer
groups): the one place experience makers (filters, metrics) and advantage estimators share.

Decisions (tests/unit/algorithms/test_advantages.py pins them):
- Groups are found from the ids only, never from row positions: a group may be spread over the
  batch and groups may differ in size.
- Statistics are float64; std is unbiased (n - 1), 0 for a group of one.
- "All agree" (no learning signal) is the spread test max - min <= eps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupStats:
    """Per-group statistics of [B] scores; group k is `ids[k]`, sample i belongs to group `index[i]`."""

    ids: torch.Tensor  # [G] int64 distinct group ids, ascending
    index: torch.Tensor  # [B] int64 position in `ids` of each sample's group
    size: torch.Tensor  # [G] int64 samples per group
    mean: torch.Tensor  # [G] float64
    variance: torch.Tensor  # [G] float64 unbiased (n - 1); 0 for groups of one sample
    std: torch.Tensor  # [G] float64 sqrt(variance) (squaring it back is not exact: keep both)
    spread: torch.Tensor  # [G] float64 max - min

    def all_agree(self, eps: float) -> torch.Tensor:
        """[G] bool: every score of the group lies within `eps` of the others (no learning signal)."""
        return self.spread <= eps

    def per_sample(self, values: torch.Tensor) -> torch.Tensor:
        """[G] group values -> [B], each sample getting its group's value."""
        return values[self.index]


def group_stats(scores: torch.Tensor, group_ids: torch.Tensor) -> GroupStats:
    """Statistics of `scores` [B] (any float dtype) per group of `group_ids` [B] int64, in float64."""
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} must both be [B]")
    if not torch.isfinite(scores).all():
        bad = torch.nonzero(~torch.isfinite(scores)).flatten().tolist()
        raise ValueError(f"non-finite scores at rows {bad}")
    values = scores.to(torch.float64)
    ids, index = torch.unique(group_ids, return_inverse=True)
    num = ids.shape[0]
    size = torch.zeros(num, dtype=torch.int64, device=values.device).index_add_(0, index, torch.ones_like(index))
    total = torch.zeros(num, dtype=torch.float64, device=values.device).index_add_(0, index, values)
    mean = total / size
    squares = torch.zeros_like(mean).index_add_(0, index, (values - mean[index]).square())
    variance = squares / (size - 1).clamp(min=1)
    high = torch.full_like(mean, -torch.inf).scatter_reduce_(0, index, values, "amax")
    low = torch.full_like(mean, torch.inf).scatter_reduce_(0, index, values, "amin")
    return GroupStats(ids=ids, index=index, size=size, mean=mean, variance=variance, std=variance.sqrt(),
                      spread=high - low)


def groups_all_agree(scores: torch.Tensor, group_ids: torch.Tensor, eps: float) -> dict[int, bool]:
    """{group id: whether all its scores lie within `eps`}, for filters that decide per group."""
    stats = group_stats(scores, group_ids)
    return dict(zip(stats.ids.tolist(), stats.all_agree(eps).tolist()))


def zero_std_group_fraction(scores: torch.Tensor, group_ids: torch.Tensor, eps: float) -> float:
    """Fraction of groups whose scores all agree within `eps` (the "zero reward std" metric)."""
    return group_stats(scores, group_ids).all_agree(eps).double().mean().item()


def first_rows(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For [B] ids: ([B] index of each row's id among the distinct ids, [K] first row holding each id)."""
    _, inverse = torch.unique(ids, return_inverse=True)
    first = torch.full((int(inverse.max()) + 1 if len(ids) else 0,), len(ids), dtype=torch.long)
    return inverse, first.scatter_reduce(0, inverse, torch.arange(len(ids)), "amin")


def identical_group_fraction(rows: torch.Tensor, group_ids: torch.Tensor) -> float | None:
    """Share of the groups of two or more rows whose rows [B, W] are all equal (the caller marks the
    padding so that rows of different lengths differ); None when no group has two rows."""
    index, first = first_rows(group_ids)
    same_as_first = (rows == rows[first[index]]).all(dim=1)
    differing = torch.zeros(len(first), dtype=torch.long).index_add_(0, index, (~same_as_first).long())
    several = torch.bincount(index, minlength=len(first)) > 1
    if not bool(several.any()):
        return None
    return float((differing[several] == 0).double().mean())
