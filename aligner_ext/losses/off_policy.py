"""Off-policy corrections for an engine whose probabilities differ from the trainer's: a detached weight
per token that multiplies each token's policy-gradient term (never the KL term), in every loss.

The engine that sampled the tokens (a generation server, bf16 kernels, MoE routing that differs
from the trainer's) computes slightly different probabilities than the trainer, so the samples come
from pi_gen, not pi_old. With rho_t = pi_old(y_t) / pi_gen(y_t) = exp(old_logprob - generation_logprob)
per token and rho = prod_t rho_t = exp(sum_t (old - generation)) over the sequence's generated tokens
(`loss.off_policy_correction`):

    none            w = 1
    token_tis       w_t = min(rho_t, C)                    truncated IS per token
    sequence_tis    w_t = min(rho, C)                      truncated IS per sequence, on all its tokens
    token_mask      w_t = rho_t * 1[low <= rho_t <= high]  masked IS per token
    sequence_mask   w_t = rho * 1[low <= rho <= high]      masked IS per sequence, on all its tokens

with C = `loss.importance_sampling_cap`, [low, high] = `loss.importance_sampling_low`, `_high`.

With asynchronous generation (docs/async.md) the sampling weights are older than the trainer's:
`generation_logprobs` are the behaviour policy's (stamped with its version, `generation_versions`)
and `old_logprobs`, recomputed before the update, the proximal policy's. Then clipped_pg with
token_tis is the decoupled clipped objective (Hilton et al. 2022, "Batch size-invariance for policy
optimization"; AReaL's decoupled PPO, Fu et al. 2025): the clip acts around the proximal policy and
each token is weighted by the capped ratio of proximal to behaviour probabilities,

    pg_t = -min(r_t A, clip(r_t) A) * min(pi_prox(y_t) / pi_behav(y_t), C),   r_t = pi / pi_prox.

AReaL drops a token whose weight exceeds C instead (token_mask with high = C is that). Beside any
correction, `loss.max_token_staleness` = k gives weight 0 to a sampled token more than k versions
behind the proximal policy (`StaleTokenMask`; `ExperienceBatch.staleness`), kept in the normaliser
as a masked token is.

Sources: truncated IS (TIS: Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training"; verl's `tis_imp_ratio_cap`, TRL's `vllm_importance_sampling_cap`); masked
IS (MIS: the Ling team's IcePop, 2025, which masks tokens whose ratio leaves [0.5, 2]) and the
token / sequence comparison of Liu, Li et al. 2025 ("When speed kills stability: demystifying RL
collapse from the training-inference mismatch"), where the sequence-level masked estimator is the
stable one; TRL names the same four modes token_truncate, sequence_truncate, token_mask, sequence_mask.

Decisions (tests/unit/losses/test_off_policy.py pins them):
- A masked token weighs 0 but stays in the loss's normaliser (the global token or sequence count),
  as a truncated weight would. verl and slime instead drop rejected tokens from the normaliser,
  which needs the mask before the step's first micro-batch; here the trainer's old log-probs of a
  single on-policy update come from the training forward itself (docs/grpo.md), so the mask is not
  known then. Kept tokens carry rho (masked IS), not 1.
- `importance_sampling_cap` > 0 with `off_policy_correction=none` selects token_tis, so a config that
  sets only the cap (docs/serving.md) keeps token-level TIS; a mode that reads no cap refuses one,
  and a truncating mode refuses a cap of 0.
- The sequence ratio is over the sampled tokens (`ExperienceBatch.sampled`: every generated token, an
  agent episode's tool results and template tokens aside), even where a variant leaves some out of
  the loss. Log-ratios are clamped to +-log_ratio_clamp
  (per token, then the sequence's sum) before exp, so a wild sequence cannot overflow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from aligner_ext.batch import ExperienceBatch
from aligner_ext.losses.settings import CORRECTIONS, TRUNCATING, correction_mode, correction_problem


@dataclass(frozen=True)
class CorrectionWeights:
    """The weights of one micro-batch and where the correction acted."""

    weight: torch.Tensor  # [b, R] detached weight of each token's policy-gradient term
    active: torch.Tensor  # [b, R] bool: truncated at the cap (tis modes) or masked out (mask modes)


class OffPolicyCorrection:
    """One of CORRECTIONS (module docstring), applied to a micro-batch's tokens."""

    def __init__(self, mode: str, cap: float, low: float, high: float, log_ratio_clamp: float):
        if mode not in CORRECTIONS:
            raise ValueError(f"unknown loss.off_policy_correction {mode!r}; known: {', '.join(CORRECTIONS)}")
        if cap < 0:
            raise ValueError(f"loss.importance_sampling_cap must be >= 0 (0: off), got {cap:g}")
        reason = correction_problem(mode, cap, low, high)  # LossConfig refuses it at load already
        if reason is not None:
            raise ValueError(reason)
        self.mode, self.cap, self.low, self.high, self.clamp = mode, cap, low, high, log_ratio_clamp
        self.reads: tuple[str, ...] = () if mode == "none" else ("generation_logprobs",)

    @classmethod
    def from_config(cls, cfg) -> "OffPolicyCorrection":
        """From the `loss` section."""
        return cls(correction_mode(cfg), cfg.importance_sampling_cap, cfg.importance_sampling_low,
                   cfg.importance_sampling_high, cfg.log_ratio_clamp)

    @property
    def sequence_level(self) -> bool:
        return self.mode.startswith("sequence")

    @torch.no_grad()
    def __call__(self, batch: ExperienceBatch) -> CorrectionWeights | None:
        """The weights of `batch`'s tokens, or None when the correction is off."""
        if self.mode == "none":
            return None
        valid = batch.sampled
        log_ratio = torch.where(valid, batch.old_logprobs - batch.generation_logprobs, 0.0)
        log_ratio = log_ratio.clamp(-self.clamp, self.clamp)
        if self.sequence_level:
            log_ratio = log_ratio.sum(dim=1, keepdim=True).clamp(-self.clamp, self.clamp).expand_as(valid)
        ratio = torch.exp(log_ratio)
        if self.mode in TRUNCATING:
            return CorrectionWeights(ratio.clamp(max=self.cap), ratio >= self.cap)
        outside = (ratio < self.low) | (ratio > self.high)
        return CorrectionWeights(torch.where(outside, 0.0, ratio), outside)

    def metrics(self, weights: CorrectionWeights | None,
                token_mean: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
        """actor/is_weight_mean and the share of tokens truncated (actor/is_capped_frac) or masked out
        (actor/is_masked_frac), each a token mean over the loss tokens."""
        if weights is None:
            return {}
        share = "actor/is_capped_frac" if self.mode in TRUNCATING else "actor/is_masked_frac"
        return {"actor/is_weight_mean": token_mean(weights.weight), share: token_mean(weights.active)}


class StaleTokenMask:
    """`loss.max_token_staleness` = k: 0 for a token sampled more than k versions behind the proximal
    policy, 1 otherwise (module docstring); None for no mask."""

    def __init__(self, max_staleness: int | None):
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"loss.max_token_staleness must be >= 0 (or unset), got {max_staleness}")
        self.max_staleness = max_staleness
        self.reads: tuple[str, ...] = () if max_staleness is None else ("generation_versions", "staleness")

    @torch.no_grad()
    def __call__(self, batch: ExperienceBatch) -> torch.Tensor | None:
        """[b, R] bool: True on the tokens kept; None when there is no mask."""
        if self.max_staleness is None:
            return None
        return batch.staleness <= self.max_staleness
