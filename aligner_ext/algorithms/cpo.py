"""CPO advantage: GRPO advantages shaped per token by how much a gold-solution hint changes them.

The experience wrapper `hint_logprobs` (experience/hint_logprobs.py) scores every response a second
time under a prompt holding the row's gold solution and stores `hint_logprobs` in the batch; the
loop's old-log-prob pass stores the policy's `entropy`. This estimator finds each group's
difficulty D (below) and computes, per response token (lp = `old_logprobs`, the un-hinted log-prob):

    Δ = lp_hint - lp,   MI = exp(lp_hint)·Δ,   ratio = clamp(exp(Δ), 1/cpo_lambda, cpo_lambda)
    U = (H - min_row H) / (max_row H - min_row H + 1e-8)     (uncertainty=minmax, the public code)
    U = H / log(vocab size)                                   (uncertainty=vocab, the original recipe)

takes the GRPO advantage A (`algorithms/advantages.py`, config section `advantage`) and applies the
wrapper named by `cpo.wrap_method` (algorithms/cpo_wrappers.py lists all 18 and their
formulas). MI is the sampled-token term of KL(p_hint || p), not a true mutual information.

Difficulty of a group (explicit group ids, `aligner_ext/groups.py::group_stats`) on the raw
outcome c (`batch.correct`; a row whose reward reports no correctness counts as correct when its
reward is > 0, the original recipe's test):
- `three`: +1 every sample correct, -1 every sample wrong, 0 mixed ("all agree" = spread <= eps,
  the same test dynamic sampling uses). The public code's version always returns 0 (it compares a
  list with a float); this one works.
- `five` (seed §4.5): fraction f correct: 0 -> -2, <= 1/4 -> -1, < 3/4 -> 0, < 1 -> +1, 1 -> +2
  (with n = 8 exactly the original recipe's 0 / 1-2 / 3-5 / 6-7 / 8 correct).
- `variance` (seed §4.5): unbiased reward variance < variance_low -> +1, > variance_high -> -1, else 0.
Wrappers test only the sign of D, so every scale drives the same branches.

Decisions:
- The shaping is computed once per step from the stored GRPO advantage and stored log-probs; the
  loss reads `batch.advantages` without changing it, so several optimisation iterations or
  mini-batches do not compound it (the public code shapes in place inside every micro-batch).
- The entropy is the policy's before the update (the public code uses the current policy's per
  micro-batch, identical on the first update); U is therefore the same for every iteration.
- Rows without a hint (`cpo.hint.missing=skip`) and tokens outside the loss mask keep GRPO's values.
"""

from __future__ import annotations

import logging
import math

import torch

from aligner_ext.algorithms.advantages import ADVANTAGES, GroupAdvantage
from aligner_ext.algorithms.cpo_wrappers import CPO_WRAPPERS, Shaping
from aligner_ext.algorithms.settings import CPOConfig
from aligner_ext.batch import ExperienceBatch
from aligner_ext.context import BuildContext
from aligner_ext.groups import group_stats

logger = logging.getLogger(__name__)

DIFFICULTY_LEVELS = {  # level -> metric name, per mode
    "three": {-1: "all_wrong", 0: "mixed", 1: "all_correct"},
    "five": {-2: "all_wrong", -1: "mostly_wrong", 0: "mixed", 1: "mostly_correct", 2: "all_correct"},
    "variance": {-1: "high_variance", 0: "mid_variance", 1: "low_variance"},
}
AGREE_EPS = 1e-6  # outcomes within this spread count as "all agree"
MINMAX_EPS = 1e-8  # added to max - min in the min-max uncertainty (the public code's value)
SEQ_EPS = 1e-10  # added to the token count in row means (the public code's value)


def outcomes(batch: ExperienceBatch) -> tuple[torch.Tensor, int]:
    """([B] bool correct, rows judged by reward > 0 because their reward reports no correctness)."""
    known = torch.isfinite(batch.correct)
    correct = torch.where(known, batch.correct >= 0.5, batch.rewards > 0)
    return correct, int((~known).sum())


def difficulty(correct: torch.Tensor, rewards: torch.Tensor, group_ids: torch.Tensor, cfg: CPOConfig) -> torch.Tensor:
    """[B] int64 difficulty of each sample's group (module docstring)."""
    if cfg.difficulty == "variance":
        stats = group_stats(rewards, group_ids)
        level = torch.where(stats.variance < cfg.variance_low, 1, torch.where(stats.variance > cfg.variance_high, -1, 0))
        return stats.per_sample(level).to(torch.int64)
    stats = group_stats(correct.to(torch.float64), group_ids)
    agree = stats.all_agree(AGREE_EPS)
    all_correct, all_wrong = agree & (stats.mean > 0.5), agree & (stats.mean <= 0.5)
    if cfg.difficulty == "three":
        level = torch.zeros_like(stats.size)
    else:
        fraction = stats.mean
        level = torch.where(fraction <= 0.25, -1, torch.where(fraction < 0.75, 0, 1)).to(torch.int64)
    top = 1 if cfg.difficulty == "three" else 2
    level = torch.where(all_correct, top, torch.where(all_wrong, -top, level))
    return stats.per_sample(level).to(torch.int64)


def difficulty_metrics(levels: torch.Tensor, group_ids: torch.Tensor, mode: str) -> dict[str, float]:
    """Fraction of groups at each difficulty level, e.g. `cpo/difficulty_all_wrong`."""
    first = {}
    for gid, level in zip(group_ids.tolist(), levels.tolist()):
        first.setdefault(gid, level)
    values = list(first.values())
    return {f"cpo/difficulty_{name}": values.count(level) / max(1, len(values))
            for level, name in DIFFICULTY_LEVELS[mode].items()}


def mutual_information(hint_logprobs: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """[B, R] MI = exp(lp_hint)·(lp_hint - lp), in the dtype of the inputs."""
    return hint_logprobs.exp() * (hint_logprobs - logprobs)


def mi_metrics(mi: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Mean, std (population) and positive fraction of MI over the tokens in `mask` [B, R] bool."""
    values = mi[mask].to(torch.float64)
    if values.numel() == 0:
        return {"cpo/mi_mean": 0.0, "cpo/mi_std": 0.0, "cpo/mi_positive_fraction": 0.0}
    return {"cpo/mi_mean": float(values.mean()), "cpo/mi_std": float(values.std(unbiased=False)),
            "cpo/mi_positive_fraction": float((values > 0).double().mean())}


def hint_gain_metrics(delta: torch.Tensor, mask: torch.Tensor, correct: torch.Tensor) -> dict[str, float]:
    """Mean Δ = lp_hint - lp per token (nats) over the tokens in `mask` [B, R] of correct and of wrong rows
    (`correct` [B]): how much the hint raises the responses it agrees with. A side with no token is left out."""
    metrics = {}
    for name, rows in (("correct", correct), ("wrong", ~correct)):
        values = delta[mask & rows[:, None]].to(torch.float64)
        if values.numel():
            metrics[f"cpo/hint_gain_{name}"] = float(values.mean())
    return metrics


def row_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, 1] Σ_t m·x / (Σ_t m + 1e-10)."""
    weights = mask.to(values.dtype)
    return (values * weights).sum(dim=1, keepdim=True) / (weights.sum(dim=1, keepdim=True) + SEQ_EPS)


def uncertainty(entropy: torch.Tensor, mask: torch.Tensor, mode: str, vocab_size: int) -> torch.Tensor:
    """[B, R] U in [0, 1] from entropy [B, R] (nats); 0 outside `mask`."""
    if mode == "vocab":
        values = entropy / math.log(vocab_size)
    else:
        low = entropy.masked_fill(~mask, math.inf).amin(dim=1, keepdim=True)
        high = entropy.masked_fill(~mask, -math.inf).amax(dim=1, keepdim=True)
        values = (entropy - low) / (high - low + MINMAX_EPS)
    return torch.where(mask, values, torch.zeros_like(values))


def shaping_inputs(batch: ExperienceBatch, correct: torch.Tensor, levels: torch.Tensor, cfg: CPOConfig,
                   vocab_size: int) -> Shaping:
    """The wrappers' inputs, in float64, from a batch carrying old and hint log-probs and entropy, with the
    rows' outcomes and group difficulty `levels` [B]."""
    response = batch.response_mask
    lp, hint_lp = batch.old_logprobs.to(torch.float64), batch.hint_logprobs.to(torch.float64)
    entropy = batch.entropy.to(torch.float64)
    delta = hint_lp - lp
    return Shaping(
        mask=response & batch.has_hint[:, None], delta=delta, mi=mutual_information(hint_lp, lp),
        ratio=delta.exp().clamp(1.0 / cfg.cpo_lambda, cfg.cpo_lambda), p_hint=hint_lp.exp(), p_old=lp.exp(),
        entropy=entropy, uncertainty=uncertainty(entropy, response, cfg.uncertainty, vocab_size),
        entropy_max=entropy.masked_fill(~response, -math.inf).amax(dim=1, keepdim=True),
        entropy_mean=row_mean(entropy, response), kl_mean=row_mean(delta, response),
        correct=correct[:, None], difficulty=levels[:, None],
        pos_alpha=cfg.pos_alpha, neg_alpha=cfg.neg_alpha, cpo_lambda=cfg.cpo_lambda,
    )


@ADVANTAGES.register("cpo")
class CPOAdvantage:
    """GRPO advantages, then the CPO wrapper `wrap_method` on the response tokens of hinted rows."""

    Config = CPOConfig
    reads = ("rewards", "correct", "old_logprobs", "entropy", "hint_logprobs", "has_hint")

    def __init__(self, cfg: CPOConfig, wrap_method: str, base: GroupAdvantage, vocab_size: int):
        self.cfg = cfg
        self.wrap_method = wrap_method
        self.wrap = CPO_WRAPPERS.get(wrap_method)
        self.base = base
        self.vocab_size = vocab_size
        self._metrics: dict[str, float] = {}
        if cfg.mi_alpha is not None:
            logger.warning("cpo.mi_alpha=%s is accepted for the original recipe's scripts but no CPO wrapper reads it",
                           cfg.mi_alpha)

    @classmethod
    def from_context(cls, ctx: BuildContext) -> "CPOAdvantage":
        return cls(ctx.cfg.cpo, ctx.cfg.cpo.wrap_method, GroupAdvantage.from_context(ctx), ctx.vocab_size)

    def __call__(self, batch: ExperienceBatch) -> torch.Tensor:
        """[B, R] float32: the shaped advantage on loss-masked tokens, 0 elsewhere."""
        base = self.base(batch).to(torch.float64)
        correct, from_reward = outcomes(batch)
        levels = difficulty(correct, batch.rewards, batch.group_ids, self.cfg)
        inputs = shaping_inputs(batch, correct, levels, self.cfg, self.vocab_size)
        shaped = torch.where(inputs.mask, self.wrap(base.clone(), inputs), base)
        change = (shaped - base)[inputs.mask]
        hinted = batch.response_mask & batch.has_hint[:, None]
        self._metrics = mi_metrics(mutual_information(batch.hint_logprobs.double(), batch.old_logprobs.double()), hinted)
        self._metrics.update(hint_gain_metrics(inputs.delta, hinted, correct))
        self._metrics.update({
            "cpo/advantage_change_mean": float(change.mean()) if change.numel() else 0.0,
            "cpo/advantage_change_abs_mean": float(change.abs().mean()) if change.numel() else 0.0,
            "cpo/shaped_token_fraction": float((change != 0).double().mean()) if change.numel() else 0.0,
            "cpo/outcome_from_reward": float(from_reward),
            **difficulty_metrics(levels, batch.group_ids, self.cfg.difficulty),
        })
        return shaped.to(torch.float32) * batch.response_mask.to(torch.float32)

    def metrics(self) -> dict[str, float]:
        """Metrics of the last call: MI mean / std / positive fraction over hinted response tokens, the hint's
        log-prob gain per token on correct and on wrong rows, mean (signed and absolute) advantage change, share of tokens changed, groups per difficulty level,
        rows whose outcome was judged from their reward."""
        return dict(self._metrics)
