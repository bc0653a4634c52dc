"""CISPO: clip the importance weight, not the update; every token keeps its gradient.

Clipped IS-weight Policy Optimization (MiniMax-M1, MiniMax 2025, arXiv 2506.13585). Per token, with
r = exp(logprob - old_logprob):

    pg_t = -sg(clip(r_t, 1 - epsilon, 1 + epsilon_high)) * A_t * logprob_t

sg = stop-gradient, so the gradient is -w A grad logprob: a REINFORCE step weighted by the clipped
ratio. PPO's clip zeroes the gradient of a token whose ratio left the range; in long reasoning
those are often rare "fork" tokens (however, wait, recheck) that the paper finds matter for
entropy and scaling. CISPO bounds only their weight.

Settings (`loss.cispo.*`): the paper sets no lower bound in practice (epsilon = 1, so the weight is
clipped below at 0, which a ratio never reaches) and tunes epsilon_high without publishing its
value; the default 3 (a weight of at most 4) is Tinker's default; NeMo-RL's CISPO recipe uses 5.

Decisions (tests/unit/losses/test_gspo_cispo.py pins them):
- Every aggregation mode and off-policy correction is defined (it is a token-level loss); the paper
  normalises by the batch's token count, token-mean. The engine/trainer correction multiplies the
  term like any loss's, separately from CISPO's own pi / pi_old weight.
- Its value is -w A logprob, not a ratio surrogate: loss/pg is not comparable with clipped_pg's
  (the gradients are, and on the first update both are -A grad logprob).
- The dual clip (clipped_pg's `loss.clip_ratio_c`) is not part of CISPO and is refused when set.
- Metrics: actor/clip_frac_high and _low are the shares of tokens whose weight was clipped above or
  below, whatever the sign of their advantage (the weight is clipped regardless of it).
"""

from __future__ import annotations


import torch

from aligner_ext.batch import ExperienceBatch
from aligner_ext.losses.base import LOSSES
from aligner_ext.losses.policy_gradient import PolicyGradientLoss
from aligner_ext.losses.settings import CISPOConfig


@LOSSES.register("cispo")
class CISPOLoss(PolicyGradientLoss):
    """-sg(clip(r)) A logprob per token, with the shared correction, KL term and aggregation."""

    Config = CISPOConfig  # its settings (aligner_ext/losses/settings.py)

    def surrogate(self, logprobs: torch.Tensor, log_ratio: torch.Tensor,
                  batch: ExperienceBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        ratio = torch.exp(log_ratio.detach())
        low, high = 1.0 - self.cfg.cispo.epsilon, 1.0 + self.cfg.cispo.epsilon_high
        weight = ratio.clamp(low, high)
        return -weight * batch.advantages * logprobs, {
            "actor/clip_frac_low": ratio < low,
            "actor/clip_frac_high": ratio > high,
        }
