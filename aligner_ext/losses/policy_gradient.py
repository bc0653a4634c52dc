"""What every policy-gradient loss shares; a loss supplies only its per-token surrogate.

For one micro-batch, with r_t = exp(clamp(logprob - old_logprob, +-log_ratio_clamp)):

    pg_t  = surrogate_t(logprob, r, A)             the loss's own term (clipped_pg, gspo, cispo)
    pg_t  = w_t * pg_t                             w from `loss.off_policy_correction` (losses/off_policy.py)
    pg_t  = 0 where the token is stale             with `loss.max_token_staleness` (losses/off_policy.py)
    kl_t  = kl_coef * k(logprob, ref_logprob)      only when kl_coef > 0 (losses/kl.py)
    loss  = aggregate(pg, response_mask, agg_mode) + aggregate(kl, response_mask, agg_mode)

with the global counts of the optimizer update (losses/aggregation.py), so the micro-batch losses
sum to the full-batch loss. A loss declares the aggregation modes and corrections defined for it
(`agg_modes`, its own mode first, which `loss.agg_mode=auto` gives; `corrections`) and whether it has
clipped_pg's dual clip (`dual_clip`): any other setting is refused in one line naming the setting and
the loss, when the config loads for a built-in loss (`settings.resolve_loss_settings`, from the
generated table aligner_ext/plugin_names.py) and when it is built for any.

Shared decisions (docs/grpo.md):
- kl_coef = 0 means no reference model: ref_logprobs is then not read, and actor/kl is reported
  only when the batch happens to carry them. The KL term is never weighted by the correction.
- The log-ratio is clamped before exp so a stale token cannot overflow the ratio.

Metrics are divided by the global counts, so the caller sums them over micro-batches: loss/pg,
loss/kl, loss/total, actor/ratio_mean, actor/approx_kl_old (token-mean k3 of the policy against
old_logprobs), actor/kl (with ref_logprobs), actor/entropy (when the caller passes entropy), the
correction's (losses/off_policy.py), actor/stale_masked_frac (with `loss.max_token_staleness`) and
the loss's own diagnostics (token means of its surrogate's flags, e.g. actor/clip_frac_low).
"""

from __future__ import annotations

import abc

import torch

from aligner_ext.batch import ExperienceBatch
from aligner_ext.context import BuildContext
from aligner_ext.losses.aggregation import AGG_MODES, aggregate, check_agg_mode
from aligner_ext.losses.base import LOSSES, GlobalCounts, Loss
from aligner_ext.losses.kl import KL_ESTIMATORS, kl_k3
from aligner_ext.losses.off_policy import CorrectionWeights, OffPolicyCorrection, StaleTokenMask
from aligner_ext.losses.settings import CORRECTIONS, LossConfig, undefined_setting


class PolicyGradientLoss(Loss):
    """A surrogate per token, the off-policy correction, the KL term and the aggregation (module docstring).

    `cfg` is the run's `loss` section (losses/settings.py). Subclasses implement `surrogate` and may
    narrow `agg_modes` and `corrections`, saying why in `restriction`.
    """

    agg_modes: tuple[str, ...] = tuple(AGG_MODES)  # its own first: what loss.agg_mode=auto gives
    corrections: tuple[str, ...] = CORRECTIONS
    restriction = ""  # why a mode or correction is not defined for this loss (refusals quote it)
    dual_clip = False  # whether it reads loss.clip_ratio_c (clipped_pg's dual clip); set for another, it is refused
    reads = ("advantages", "old_logprobs", "response_mask")

    def __init__(self, cfg: LossConfig):
        if cfg.kl_coef < 0.0:
            raise ValueError(f"loss.kl_coef must be >= 0, got {cfg.kl_coef}")
        if cfg.log_ratio_clamp <= 0.0:
            raise ValueError(f"loss.log_ratio_clamp must be > 0, got {cfg.log_ratio_clamp}")
        self.agg_mode = self.agg_modes[0] if cfg.agg_mode == "auto" else cfg.agg_mode
        check_agg_mode(self.agg_mode)
        if cfg.clip_ratio_c > 0 and not self.dual_clip:
            raise ValueError(f"loss.clip_ratio_c={cfg.clip_ratio_c:g} is clipped_pg's dual clip; loss {self.name} does "
                             "not read it (set it to 0)")
        self.cfg = cfg
        self.correction = OffPolicyCorrection.from_config(cfg)
        problem = undefined_setting(self.name, self.agg_mode, self.correction.mode, self.agg_modes, self.corrections,
                                    self.restriction)
        if problem is not None:
            raise ValueError(problem)
        self.stale_mask = StaleTokenMask(cfg.max_token_staleness)
        self.kl_fn = KL_ESTIMATORS.get(cfg.kl_estimator)
        self.reads = (self.reads + (("ref_logprobs",) if cfg.kl_coef > 0 else ()) + self.correction.reads
                      + self.stale_mask.reads)

    @property
    def name(self) -> str:
        return LOSSES.name_of(type(self)) or type(self).__name__

    @classmethod
    def from_context(cls, ctx: BuildContext) -> "PolicyGradientLoss":
        return cls(ctx.cfg.loss)

    @abc.abstractmethod
    def surrogate(self, logprobs: torch.Tensor, log_ratio: torch.Tensor,
                  batch: ExperienceBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The per-token policy-gradient term and its diagnostics.

        Args:
            logprobs: [b, R] current log-probs (with grad).
            log_ratio: [b, R] logprobs - old_logprobs, clamped (with grad).
            batch: the micro-batch (advantages, masks).
        Returns:
            ([b, R] term to minimise, {metric name: [b, R] values whose token mean is logged}).
        """

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
        cfg, mask = self.cfg, batch.response_mask
        log_ratio = (logprobs - batch.old_logprobs).clamp(-cfg.log_ratio_clamp, cfg.log_ratio_clamp)
        per_token, diagnostics = self.surrogate(logprobs, log_ratio, batch)
        weights = self.correction(batch)
        if weights is not None:
            per_token = per_token * weights.weight
        fresh = self.stale_mask(batch)
        if fresh is not None:
            per_token = per_token * fresh
        pg_loss = aggregate(per_token, mask, self.agg_mode, counts)

        kl_loss = torch.zeros_like(pg_loss)
        if cfg.kl_coef > 0:
            kl_loss = cfg.kl_coef * aggregate(self.kl_fn(logprobs, batch.ref_logprobs), mask, self.agg_mode, counts)
        total = pg_loss + kl_loss

        metrics = {"loss/pg": pg_loss, "loss/kl": kl_loss, "loss/total": total}
        if fresh is not None:
            diagnostics["actor/stale_masked_frac"] = ~fresh
        metrics.update(self._token_metrics(log_ratio, logprobs, batch, counts, entropy, diagnostics, weights))
        # one copy to the host for all of them: each .item() would wait for the device
        return total, dict(zip(metrics, torch.stack([value.detach().double() for value in metrics.values()]).tolist()))

    @torch.no_grad()
    def _token_metrics(self, log_ratio: torch.Tensor, logprobs: torch.Tensor, batch: ExperienceBatch,
                       counts: GlobalCounts, entropy: torch.Tensor | None, diagnostics: dict[str, torch.Tensor],
                       weights: CorrectionWeights | None) -> dict[str, torch.Tensor]:
        """Token-mean diagnostics, each divided by the global token count (0-dim, on the device)."""
        mask = batch.response_mask

        def token_mean(values: torch.Tensor) -> torch.Tensor:
            return aggregate(values.to(logprobs.dtype), mask, "token-mean", counts)

        metrics = {name: token_mean(values) for name, values in diagnostics.items()}
        metrics["actor/ratio_mean"] = token_mean(torch.exp(log_ratio))
        metrics["actor/approx_kl_old"] = token_mean(kl_k3(logprobs, batch.old_logprobs))
        if batch.ref_logprobs is not None:
            metrics["actor/kl"] = token_mean(self.kl_fn(logprobs, batch.ref_logprobs))
        if entropy is not None:
            metrics["actor/entropy"] = token_mean(entropy)
        metrics.update(self.correction.metrics(weights, token_mean))
        return metrics

