"""GSPO: one importance ratio per sequence, length-normalised and clipped per sequence.

Group Sequence Policy Optimization (Zheng et al. 2025, Qwen, arXiv 2507.18071). For sequence i with
loss-masked tokens T_i (|T_i| of them) and advantage A:

    s_i  = exp( (1 / |T_i|) sum_{t in T_i} (logprob_t - old_logprob_t) )
    J_i  = min(s_i A_i, clip(s_i, 1 - epsilon, 1 + epsilon_high) A_i)
    loss = -(1 / N_seq) sum_i J_i                                     (agg_mode seq-mean-token-mean)

with the paper's clip range epsilon = 3e-4, epsilon_high = 4e-4 (`loss.gspo.*`): a sequence ratio
moves far less than a token's, so the range is orders of magnitude narrower than PPO's 0.2.

Implemented in the paper's GSPO-token form, per token:

    s_{i,t} = sg(s_i) * pi(y_t) / sg(pi(y_t))        value s_i, gradient s_i * grad logprob_t
    pg_t    = -min(s_{i,t} A_{i,t}, clip(s_{i,t}) A_{i,t})

whose sequence mean has the value and the gradient of GSPO when A is the same on every token of a
sequence, and which stays defined when a variant shapes advantages per token (CPO).

Decisions (tests/unit/losses/test_gspo_cispo.py pins them):
- Aggregation: seq-mean-token-mean only. token-mean and seq-mean-token-sum would weight each
  sequence's objective by its length, which the length-normalised ratio is there to avoid; they
  are refused when the loss is built.
- Off-policy corrections: none, sequence_tis, sequence_mask. A token-level weight inside one
  clipped sequence ratio would re-weight the sequence's tokens unequally, the token-level noise
  GSPO removes; the token modes (and `importance_sampling_cap` alone, which means token_tis) are
  refused.
- The dual clip (clipped_pg's `loss.clip_ratio_c`) is not part of GSPO and is refused when set.
- Metrics: actor/clip_frac_low / _high are token shares whose sequence is clipped (the paper's
  "fraction of clipped tokens", about two orders of magnitude above GRPO's), actor/seq_ratio_mean
  the token mean of s_i.
"""

from __future__ import annotations


import torch

from aligner_ext.batch import ExperienceBatch
from aligner_ext.losses.base import LOSSES
from aligner_ext.losses.policy_gradient import PolicyGradientLoss
from aligner_ext.losses.settings import GSPOConfig


@LOSSES.register("gspo")
class GSPOLoss(PolicyGradientLoss):
    """Sequence-level ratio s_i, clipped per sequence, on every token of the sequence (GSPO-token form)."""

    Config = GSPOConfig  # its settings (aligner_ext/losses/settings.py)

    agg_modes = ("seq-mean-token-mean",)
    corrections = ("none", "sequence_tis", "sequence_mask")
    restriction = "its ratio, clip and advantage are per sequence"

    def surrogate(self, logprobs: torch.Tensor, log_ratio: torch.Tensor,
                  batch: ExperienceBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask, adv, clip = batch.response_mask, batch.advantages, self.cfg.gspo
        lengths = mask.sum(dim=1, keepdim=True).clamp(min=1)
        seq_log_ratio = torch.where(mask, log_ratio, 0.0).sum(dim=1, keepdim=True) / lengths
        ratio = torch.exp(seq_log_ratio.detach() + logprobs - logprobs.detach())  # GSPO-token: s_i in value
        clipped = ratio.clamp(1.0 - clip.epsilon, 1.0 + clip.epsilon_high)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        seq_ratio = torch.exp(seq_log_ratio.detach()).expand_as(ratio)
        return per_token, {
            "actor/clip_frac_low": (seq_ratio < 1.0 - clip.epsilon) & (adv < 0),
            "actor/clip_frac_high": (seq_ratio > 1.0 + clip.epsilon_high) & (adv > 0),
            "actor/seq_ratio_mean": seq_ratio,
        }
