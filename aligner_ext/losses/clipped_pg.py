"""Clipped policy-gradient loss (PPO / GRPO surrogate) with asymmetric clip and an optional KL term.

Per response token, with r = exp(clamp(logprob - old_logprob, -c, c)) and advantage A:

    pg = -min(r * A, clip(r, 1 - epsilon, 1 + epsilon_high) * A)
    pg = min(pg, -clip_ratio_c * A)   where A < 0, when clip_ratio_c > 0 (dual-clip)
    pg = w * pg,  w = min(exp(old_logprob - generation_logprob), C)   when C = importance_sampling_cap > 0
    kl = kl_coef * k(logprob, ref_logprob)          (only when kl_coef > 0; k in losses/kl.py)
    loss = aggregate(pg + kl, response_mask, agg_mode, global counts)

Sources: PPO (Schulman et al. 2017) for the surrogate; GRPO (Shao et al. 2024, DeepSeekMath) for the
KL term in the loss rather than in the reward; DAPO (Yu et al. 2025) for the decoupled upper clip
("clip-higher", epsilon_high = 0.28) and token-mean aggregation; dual-clip PPO (Ye et al. 2020, verl's
`clip_ratio_c`, typically 3) for the cap on a negative-advantage token whose ratio has run far above 1;
truncated importance sampling (TIS: Yao et al. 2025, "Your efficient RL framework secretly brings you
off-policy RL training"; verl's `tis_imp_ratio_cap`, TRL's `vllm_importance_sampling_cap`) for w: the
engine that sampled the tokens (a generation server, bf16 kernels) computes slightly different
probabilities than the trainer, so the samples come from pi_gen, not pi_old; w re-weights each
token's surrogate by pi_old / pi_gen, truncated at C, detached, and leaves the KL term alone.

Decisions:
- Defaults are symmetric (epsilon = epsilon_high = 0.2), plain GRPO; DAPO sets epsilon_high. Dual-clip
  is off (clip_ratio_c = 0); when on it must exceed 1, so the cap sits above the usual clip.
- The log-ratio is clamped to +-log_ratio_clamp before exp so a stale token cannot overflow the ratio;
  the clip already zeroes the gradient far before e^20, so the clamp never changes a useful value.
- kl_coef = 0 means no reference model: ref_logprobs is then not required, and the KL metric is
  reported only when the batch happens to carry them.
- On the first iteration (old_logprobs == logprobs.detach()) r = 1 and the loss is the aggregated -A.
- TIS is off by default (C = 0). On, it reads `generation_logprobs` (an engine that returns none is
  an error naming the field); old_logprobs are the trainer's, from the old-log-prob pass or, on the
  on-policy shortcut, from the same training forward, detached: the same values either way.

Metrics are divided by the global counts, so the caller sums them over micro-batches:
loss/pg, loss/kl (the KL term's share of the loss), loss/total, actor/clip_frac_low (tokens where
r < 1 - epsilon and A < 0: the low clip is active), actor/clip_frac_high (r > 1 + epsilon_high and
A > 0), actor/clip_frac_dual (r > clip_ratio_c and A < 0: the dual clip is active; with it on), actor/ratio_mean, actor/approx_kl_old (token-mean k3 of the policy against old_logprobs),
actor/kl (token-mean KL estimate vs the reference, when ref_logprobs is set), actor/entropy
(token-mean, when the caller passes entropy) and, with TIS, actor/is_weight_mean (token-mean w) and
actor/is_capped_frac (tokens where the truncation is active).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from aligner_ext.batch import ExperienceBatch
from aligner_ext.context import BuildContext
from aligner_ext.losses.aggregation import AGG_MODES, aggregate, check_agg_mode
from aligner_ext.losses.base import LOSSES, GlobalCounts, Loss
from aligner_ext.losses.kl import KL_ESTIMATORS, kl_k3
from aligner_ext.rules import choice, number, plugin


@LOSSES.register("clipped_pg")
class ClippedPGLoss(Loss):
    """-min(r A, clip(r) A) + kl_coef * KL, aggregated over response tokens."""

    @dataclass
    class Config:
        """The clipped policy-gradient objective: clip range, aggregation and KL penalty."""

        epsilon: float = number(0.2, ge=0, lt=1)  # lower clip: the ratio is clipped below at 1 - epsilon
        epsilon_high: float = number(0.2, ge=0)  # upper clip: clipped above at 1 + epsilon_high (DAPO: 0.28)
        agg_mode: str = choice("token-mean", *AGG_MODES)  # token-mean | seq-mean-token-mean | seq-mean-token-sum
        kl_coef: float = number(0.0, ge=0)  # beta, weight of the KL(pi || ref) term; 0 disables the reference model
        kl_estimator: str = plugin("k3", "aligner_ext.losses.kl:KL_ESTIMATORS")  # k1 | k2 | k3 (losses/kl.py)
        log_ratio_clamp: float = number(20.0, gt=0)  # |logprob - old_logprob| bound before exp, in nats
        clip_ratio_c: float = number(0.0, ge=0)  # dual-clip: a negative-advantage token's loss is capped at -clip_ratio_c * A (verl: 3.0); 0 disables it
        importance_sampling_cap: float = number(0.0, ge=0)  # truncated importance sampling: each token's surrogate times min(pi_old / pi_gen, cap), pi_gen the engine's log-probs (verl / TRL use 2); 0 disables it

    reads = ("advantages", "old_logprobs", "response_mask")

    def __init__(self, cfg: Config):
        if not 0.0 <= cfg.epsilon < 1.0:
            raise ValueError(f"loss.epsilon must be in [0, 1), got {cfg.epsilon}")
        if cfg.epsilon_high < 0.0:
            raise ValueError(f"loss.epsilon_high must be >= 0, got {cfg.epsilon_high}")
        if cfg.kl_coef < 0.0:
            raise ValueError(f"loss.kl_coef must be >= 0, got {cfg.kl_coef}")
        if cfg.clip_ratio_c != 0.0 and cfg.clip_ratio_c <= 1.0:
            raise ValueError(f"loss.clip_ratio_c must be > 1 (or 0: no dual clip), got {cfg.clip_ratio_c}")
        if cfg.importance_sampling_cap < 0.0:
            raise ValueError(f"loss.importance_sampling_cap must be >= 0 (0: off), got {cfg.importance_sampling_cap}")
        if cfg.log_ratio_clamp <= 0.0:
            raise ValueError(f"loss.log_ratio_clamp must be > 0, got {cfg.log_ratio_clamp}")
        check_agg_mode(cfg.agg_mode)
        self.cfg = cfg
        self.kl_fn = KL_ESTIMATORS.get(cfg.kl_estimator)
        if cfg.kl_coef > 0:
            self.reads = self.reads + ("ref_logprobs",)
        if cfg.importance_sampling_cap > 0:
            self.reads = self.reads + ("generation_logprobs",)

    @classmethod
    def from_context(cls, ctx: BuildContext) -> "ClippedPGLoss":
        return cls(ctx.cfg.loss)

    def __call__(
        self,
        logprobs: torch.Tensor,
        batch: ExperienceBatch,
        counts: GlobalCounts,
        entropy: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if self.cfg.kl_coef > 0 and batch.ref_logprobs is None:
            raise ValueError("loss.kl_coef > 0 needs batch.ref_logprobs: enable the reference model or set kl_coef 0")
        self.check_batch(logprobs, batch)
        cfg, mask, adv = self.cfg, batch.response_mask, batch.advantages
        log_ratio = (logprobs - batch.old_logprobs).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
        ratio = torch.exp(log_ratio)
        clipped = ratio.clamp(1.0 - cfg.epsilon, 1.0 + cfg.epsilon_high)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        if cfg.clip_ratio_c > 0:
            per_token = torch.where(adv < 0, torch.minimum(per_token, -cfg.clip_ratio_c * adv), per_token)
        is_weight = self._importance_weight(batch)
        if is_weight is not None:
            per_token = per_token * is_weight
        pg_loss = aggregate(per_token, mask, cfg.agg_mode, counts)

        kl_loss = torch.zeros_like(pg_loss)
        if cfg.kl_coef > 0:
            kl_loss = cfg.kl_coef * aggregate(self.kl_fn(logprobs, batch.ref_logprobs), mask, cfg.agg_mode, counts)
        total = pg_loss + kl_loss

        metrics = {"loss/pg": pg_loss.item(), "loss/kl": kl_loss.item(), "loss/total": total.item()}
        metrics.update(self._token_metrics(ratio, logprobs, batch, counts, entropy, is_weight))
        return total, metrics

    @torch.no_grad()
    def _importance_weight(self, batch: ExperienceBatch) -> torch.Tensor | None:
        """TIS weight min(exp(old - generation), cap) per token, or None when off."""
        if self.cfg.importance_sampling_cap <= 0:
            return None
        log_weight = (batch.old_logprobs - batch.generation_logprobs).clamp(-self.cfg.log_ratio_clamp,
                                                                             self.cfg.log_ratio_clamp)
        return torch.exp(log_weight).clamp(max=self.cfg.importance_sampling_cap)

    @torch.no_grad()
    def _token_metrics(
        self,
        ratio: torch.Tensor,
        logprobs: torch.Tensor,
        batch: ExperienceBatch,
        counts: GlobalCounts,
        entropy: torch.Tensor | None,
        is_weight: torch.Tensor | None,
    ) -> dict[str, float]:
        """Token-mean diagnostics, each divided by the global token count."""
        mask, adv = batch.response_mask, batch.advantages

        def token_mean(values: torch.Tensor) -> float:
            return aggregate(values.to(ratio.dtype), mask, "token-mean", counts).item()

        metrics = {
            "actor/clip_frac_low": token_mean((ratio < 1.0 - self.cfg.epsilon) & (adv < 0)),
            "actor/clip_frac_high": token_mean((ratio > 1.0 + self.cfg.epsilon_high) & (adv > 0)),
            "actor/ratio_mean": token_mean(ratio),
            "actor/approx_kl_old": token_mean(kl_k3(logprobs, batch.old_logprobs)),
        }
        if self.cfg.clip_ratio_c > 0:
            metrics["actor/clip_frac_dual"] = token_mean((ratio > self.cfg.clip_ratio_c) & (adv < 0))
        if batch.ref_logprobs is not None:
            metrics["actor/kl"] = token_mean(self.kl_fn(logprobs, batch.ref_logprobs))
        if entropy is not None:
            metrics["actor/entropy"] = token_mean(entropy)
        if is_weight is not None:
            metrics["actor/is_weight_mean"] = token_mean(is_weight)
            metrics["actor/is_capped_frac"] = token_mean(is_weight >= self.cfg.importance_sampling_cap)
        return metrics
