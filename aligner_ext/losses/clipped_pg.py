"""Clipped policy-gradient loss (PPO / GRPO surrogate) with asymmetric clip and optional dual clip.

Per response token, with r = exp(clamp(logprob - old_logprob, -c, c)) and advantage A:

    pg = -min(r * A, clip(r, 1 - epsilon, 1 + epsilon_high) * A)
    pg = min(pg, -clip_ratio_c * A)   where A < 0, when clip_ratio_c > 0 (dual-clip)

then the off-policy correction, the KL term and the aggregation every policy-gradient loss shares
(losses/policy_gradient.py): `loss.importance_sampling_cap` = C > 0 alone is token-level truncated
importance sampling, w = min(exp(old_logprob - generation_logprob), C) per token (losses/off_policy.py).

Sources: PPO (Schulman et al. 2017) for the surrogate; GRPO (Shao et al. 2024, DeepSeekMath) for the
KL term in the loss rather than in the reward; DAPO (Yu et al. 2025) for the decoupled upper clip
("clip-higher", epsilon_high = 0.28) and token-mean aggregation; dual-clip PPO (Ye et al. 2020, verl's
`clip_ratio_c`, typically 3) for the cap on a negative-advantage token whose ratio has run far above 1.

Decisions:
- Defaults are symmetric (epsilon = epsilon_high = 0.2), plain GRPO; DAPO sets epsilon_high. Dual-clip
  is off (clip_ratio_c = 0); when on it must exceed 1, so the cap sits above the usual clip.
- On the first iteration (old_logprobs == logprobs.detach()) r = 1 and the loss is the aggregated -A.
- Every aggregation mode and off-policy correction is defined for it.

Metrics besides the shared ones: actor/clip_frac_low (tokens where r < 1 - epsilon and A < 0: the low
clip is active), actor/clip_frac_high (r > 1 + epsilon_high and A > 0), actor/clip_frac_dual
(r > clip_ratio_c and A < 0: the dual clip is active; with it on).
"""

from __future__ import annotations

import torch

from aligner_ext.batch import ExperienceBatch
from aligner_ext.losses.base import LOSSES
from aligner_ext.losses.policy_gradient import PolicyGradientLoss
from aligner_ext.losses.settings import LossConfig


@LOSSES.register("clipped_pg")
class ClippedPGLoss(PolicyGradientLoss):
    """-min(r A, clip(r) A) per token (PPO / GRPO), with the shared correction, KL term and aggregation."""

    Config = LossConfig
    dual_clip = True

    def __init__(self, cfg: LossConfig):
        if not 0.0 <= cfg.epsilon < 1.0:
            raise ValueError(f"loss.epsilon must be in [0, 1), got {cfg.epsilon}")
        if cfg.epsilon_high < 0.0:
            raise ValueError(f"loss.epsilon_high must be >= 0, got {cfg.epsilon_high}")
        super().__init__(cfg)

    def surrogate(self, logprobs: torch.Tensor, log_ratio: torch.Tensor,
                  batch: ExperienceBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg, adv = self.cfg, batch.advantages
        ratio = torch.exp(log_ratio)
        clipped = ratio.clamp(1.0 - cfg.epsilon, 1.0 + cfg.epsilon_high)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        diagnostics = {
            "actor/clip_frac_low": (ratio < 1.0 - cfg.epsilon) & (adv < 0),
            "actor/clip_frac_high": (ratio > 1.0 + cfg.epsilon_high) & (adv > 0),
        }
        if cfg.clip_ratio_c > 0:
            per_token = torch.where(adv < 0, torch.minimum(per_token, -cfg.clip_ratio_c * adv), per_token)
            diagnostics["actor/clip_frac_dual"] = (ratio > cfg.clip_ratio_c) & (adv < 0)
        return per_token, diagnostics
