"""Advantage estimators: sequence rewards -> per-token advantages [B, R].

GRPO (Shao et al. 2024, DeepSeekMath) scores each sample against the other samples of its prompt
draw (its group, by `batch.group_ids`):

    A_i = (r_i - mean_g(r)) / max(std_g(r), std_floor)      (use_std = True, GRPO)
    A_i =  r_i - mean_g(r)                                  (use_std = False, Dr.GRPO, Liu et al. 2025)

and every loss-masked response token of sample i gets A_i.

Decisions:
- Groups are found from the explicit group ids only (never from tokens or row positions): a group
  may be spread over the batch and groups may differ in size.
- std is the unbiased (Bessel, n - 1) estimate, as in verl and TRL, so the same rewards give the
  same advantages as there. A group of one sample has no spread: its std is 0 and its advantage 0.
- Statistics are computed in float64. Rewards arrive as float32, whose 24-bit mantissas make every
  partial sum of n <= 2^29 equal values exact in float64, so a group of identical rewards such as
  0.35 gets a mean equal to each reward and an advantage of exactly 0 (float32 sums leave a residue
  that the std division then inflates). Groups whose rewards are all identical are also set to 0
  explicitly, so the guarantee holds for float64 input too.
- The floor is applied as max(std, floor), not std + eps: groups with a real spread are normalised
  exactly, and only near-ties are damped. 1e-4 (TRL's eps) is far below any meaningful reward
  difference on a [0, 1] scale, yet large enough that float32 noise (~1e-7 on rewards of order 1)
  turns into advantages of order 1e-3 instead of +-1.
- Group statistics (`aligner_ext/groups.py`, shared with the experience makers) judge "all agree"
  (no learning signal in a group) by the spread max - min <= eps, which is what dynamic-sampling
  filters and difficulty masks need; see `GroupStats.all_agree`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from aligner_ext.algorithms.settings import AdvantageConfig, check_group_size
from aligner_ext.batch import ExperienceBatch
from aligner_ext.context import BuildContext
from aligner_ext.groups import group_stats
from aligner_ext.registry import Registry

ADVANTAGES = Registry("advantage estimator")


class AdvantageFn(Protocol):
    """Turns a scored batch into per-token advantages [B, R] float32 (0 outside response_mask)."""

    reads: tuple[str, ...]  # optional ExperienceBatch fields it needs, checked at build (trainer/contracts.py)

    def __call__(self, batch: ExperienceBatch) -> torch.Tensor: ...

    def metrics(self) -> dict[str, float]:
        """What the last call wants logged for the step (may be empty)."""


def group_baseline_normalize(
    scores: torch.Tensor, group_ids: torch.Tensor, use_std: bool, std_floor: float
) -> torch.Tensor:
    """[B] advantages (float64): score minus its group mean, divided by max(group std, std_floor) if use_std."""
    stats = group_stats(scores, group_ids)
    centred = scores.to(torch.float64) - stats.per_sample(stats.mean)
    if use_std:
        centred = centred / stats.per_sample(stats.std.clamp(min=std_floor))
    identical = stats.per_sample(stats.spread == 0)
    return torch.where(identical, torch.zeros_like(centred), centred)


def check_finite_rewards(batch: ExperienceBatch) -> None:
    """Raise naming the rows whose reward is NaN or infinite (a reward function's bug, not a number to train on)."""
    if not torch.isfinite(batch.rewards).all():
        rows = torch.nonzero(~torch.isfinite(batch.rewards)).flatten().tolist()
        raise ValueError(f"non-finite rewards for rows {[batch.samples[i].row.row_id for i in rows]}")


@ADVANTAGES.register("grpo", "group_norm")
class GroupAdvantage:
    """GRPO group-normalised advantage, broadcast over the loss-masked response tokens.

    Other estimators that give each sample one value subclass it and override `per_sample`
    (algorithms/estimators.py); they share the `advantage` config section.
    """

    Config = AdvantageConfig  # its settings (aligner_ext/algorithms/settings.py)

    reads = ("rewards",)
    min_group_size = 2  # a group of one has advantage 0: nothing would be trained

    def __init__(self, cfg: Config):
        if cfg.std_floor <= 0:
            raise ValueError(f"advantage.std_floor must be > 0, got {cfg.std_floor}")
        self.cfg = cfg
        self._metrics: dict[str, float] = {}

    @classmethod
    def from_context(cls, ctx: BuildContext) -> "GroupAdvantage":
        check_group_size(ctx.cfg)
        return cls(ctx.cfg.advantage)

    def __call__(self, batch: ExperienceBatch) -> torch.Tensor:
        """[B, R] float32: A_i on every token where response_mask is True, 0 elsewhere."""
        check_finite_rewards(batch)
        return self.per_sample(batch).to(torch.float32)[:, None] * batch.response_mask.to(torch.float32)

    def per_sample(self, batch: ExperienceBatch) -> torch.Tensor:
        """Override point: [B] float64 advantage of each sample; GRPO's is its group-normalised reward."""
        return group_baseline_normalize(batch.rewards, batch.group_ids, self.cfg.use_std, self.cfg.std_floor)

    def metrics(self) -> dict[str, float]:
        """What the last call wants logged for the step (none for GRPO)."""
        return dict(self._metrics)
