"""Advantage estimators researchers compare GRPO with: RLOO, REINFORCE++ and REINFORCE++-baseline.

Each turns sequence rewards r into one value per sample, broadcast over its loss-masked tokens:

    rloo                            A_i = r_i - mean_{j in g, j != i} r_j = n_g / (n_g - 1) * (r_i - mean_g r)
    reinforce_plus_plus             A_i = (r_i - mu) / max(sigma, std_floor)
    reinforce_plus_plus_baseline    a_i = r_i - mean_g r;   A_i = (a_i - mu) / max(sigma, std_floor)

with g the sample's group (`batch.group_ids`), n_g its size, and mu, sigma the mean and standard
deviation over every loss-masked response token of the batch (token i carries its sample's value).

Sources: RLOO, the leave-one-out baseline of Kool et al. 2019 ("Buy 4 REINFORCE samples, get a
baseline for free!"), applied to LLMs by Ahmadian et al. 2024 ("Back to basics: revisiting
REINFORCE style optimization for learning from human feedback in LLMs"); REINFORCE++ and
REINFORCE++-baseline, Hu 2025 ("REINFORCE++: a simple and efficient approach for aligning large
language models", arXiv 2501.03262), whose normalisation over the global batch replaces the
per-prompt std of GRPO.

Decisions (tests/unit/algorithms/test_estimators.py pins them):
- Groups come from the explicit group ids, may be spread over the batch and differ in size
  (`aligner_ext/groups.py`), as for GRPO. Statistics are float64.
- RLOO: a group of one has no other sample to compare with, so its advantage is 0; a group whose
  rewards are all identical gets exactly 0. It reads no `advantage.*` setting; `use_std=false`
  (which asks for something RLOO does not do anyway) is refused so that the setting is not silently
  ignored.
- REINFORCE++: the batch statistics are token-weighted (every loss-masked token counts once, so a
  long response weighs more) with the population variance, as the paper's implementation
  (OpenRLHF) computes them; a row with no loss-masked token (padding, a response masked out by
  overlong filtering) takes no part in them. The KL penalty stays in the loss (`loss.kl_coef`)
  rather than in the reward: the paper's KL-in-reward is not implemented. `advantage.std_floor`
  bounds sigma from below as GRPO's group std; `advantage.use_std=false` centres by mu only.
  When every counted token carries the same value, sigma is 0 and every advantage is exactly 0.
- REINFORCE++-baseline subtracts the group mean first (exactly 0 for an all-equal group or a group
  of one), then normalises over the batch as above. The batch step is the paper's affine map on
  every token, so an all-equal group ends at -mu / sigma, not 0: mu is 0 only when the centred
  values balance token by token (equal lengths within each group).
- An empty batch gives an empty [0, R] tensor.
- Each subclasses GroupAdvantage, overriding only `per_sample`: the reward checks, the broadcast over
  the loss mask, `from_context` (rollout.n against `min_group_size`) and the config section are GRPO's.
"""

from __future__ import annotations

import torch

from aligner_ext.algorithms.advantages import ADVANTAGES, GroupAdvantage, group_baseline_normalize
from aligner_ext.batch import ExperienceBatch
from aligner_ext.groups import group_stats


def group_centred(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[B] float64: each reward minus its group mean; exactly 0 in a group whose rewards are identical."""
    return group_baseline_normalize(rewards, group_ids, use_std=False, std_floor=1.0)  # no division: floor unused


def leave_one_out(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[B] float64: each reward minus the mean of the other rewards of its group (0 for a group of one).

    r_i - (S - r_i) / (n - 1) = n / (n - 1) * (r_i - S / n), with S the group's sum and n its size.
    """
    stats = group_stats(rewards, group_ids)
    size = stats.per_sample(stats.size).to(torch.float64)
    return group_centred(rewards, group_ids) * size / (size - 1).clamp(min=1)


def batch_normalize(values: torch.Tensor, mask: torch.Tensor, use_std: bool,
                    std_floor: float) -> tuple[torch.Tensor, float, float]:
    """([B] float64 normalised values, mu, sigma) for per-sample `values` [B] over the loss-masked tokens.

    mu and sigma are the mean and population std of the values carried by every token of `mask`
    [B, R] bool (one value per row, repeated over its tokens); rows without a masked token do not count.
    """
    values = values.to(torch.float64)
    tokens = mask.sum(dim=1).to(torch.float64)
    total = tokens.sum()
    if total == 0:
        return torch.zeros_like(values), 0.0, 0.0
    counted = values[tokens > 0]
    if counted.max() == counted.min():  # one value everywhere: exactly 0, not a float residue
        return torch.zeros_like(values), float(counted[0]), 0.0
    mean = (tokens * values).sum() / total
    std = ((tokens * (values - mean).square()).sum() / total).sqrt()
    centred = values - mean
    return (centred / std.clamp(min=std_floor) if use_std else centred), float(mean), float(std)


@ADVANTAGES.register("rloo")
class LeaveOneOutAdvantage(GroupAdvantage):
    """RLOO: A_i = r_i - mean of the other samples of its group (Kool et al. 2019; Ahmadian et al. 2024)."""

    def __init__(self, cfg: GroupAdvantage.Config):
        if not cfg.use_std:
            raise ValueError("advantage.use_std=false: rloo divides by no std (it reads no advantage.* setting)")
        super().__init__(cfg)

    def per_sample(self, batch: ExperienceBatch) -> torch.Tensor:
        return leave_one_out(batch.rewards, batch.group_ids)


@ADVANTAGES.register("reinforce_plus_plus", "reinforce++")
class ReinforcePlusPlusAdvantage(GroupAdvantage):
    """REINFORCE++: A_i = (r_i - mu) / max(sigma, std_floor) over the batch's loss-masked tokens (Hu 2025)."""

    min_group_size = 1  # no group statistic: it trains with one sample per prompt

    def centred(self, batch: ExperienceBatch) -> torch.Tensor:
        """Override point: [B] the values the batch statistics normalise (the reward itself)."""
        return batch.rewards.to(torch.float64)

    def per_sample(self, batch: ExperienceBatch) -> torch.Tensor:
        values, mean, std = batch_normalize(self.centred(batch), batch.response_mask, self.cfg.use_std,
                                            self.cfg.std_floor)
        self._metrics = {"advantage/batch_mean": mean, "advantage/batch_std": std}
        return values


@ADVANTAGES.register("reinforce_plus_plus_baseline", "reinforce++_baseline")
class ReinforcePlusPlusBaselineAdvantage(ReinforcePlusPlusAdvantage):
    """REINFORCE++-baseline: r_i minus its group mean, then normalised over the batch (Hu 2025)."""

    min_group_size = 2  # a group of one has no baseline but itself

    def centred(self, batch: ExperienceBatch) -> torch.Tensor:
        return group_centred(batch.rewards, batch.group_ids)
