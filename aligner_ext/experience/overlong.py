"""Overlong reward shaping and overlong filtering (DAPO), one experience wrapper around any single-round maker.

DAPO (Yu et al. 2025, arXiv 2503.14476, section 3.4). With L_max = `rollout.max_response_length`, a
buffer of L_cache tokens before it and |y| the response's generated tokens, the soft overlong
punishment is added to the reward:

    R_length(y) = 0                                  |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache     L_max - L_cache < |y| <= L_max
                = -1                                 |y| > L_max
    reward     += overlong_penalty * R_length(y)     (also on the response's last token in token_rewards)

Overlong filtering masks a truncated response (one cut at L_max without finishing: finish reason
"length") out of the loss: its row of `response_mask` is cleared.

Decisions (docs/variants/dapo.md; tests/unit/experience/test_overlong.py pins them):
- The buffer is a fraction of the cap, L_cache = round(overlong_buffer_fraction * L_max) tokens, so
  one overlay value fits every cap: the paper's 4096 tokens of its 20480 is 0.2, which is 5 tokens
  of the demo's 24 (a fraction that rounds to 0 tokens is refused).
- |y| counts the generated tokens, the end token included (verl's valid response length). The
  engine stops at the cap, so |y| <= L_max and a response cut there gets -overlong_penalty.
- The advantage estimators read the shaped `rewards`; `correct` keeps the raw outcome, so accuracy
  and dynamic sampling's default filter (`correct`) see it unshaped, while its `seq_reward` filter
  sums the shaped token rewards (DAPO's recipe adds the penalty before its group filter). The
  wrapper is listed first (innermost) in `algorithm.experience_wrappers` for that reason.
- A filtered response keeps its reward in its group's statistics (it was sampled, and scored);
  only its tokens leave the loss and every loss normaliser (which counts `response_mask`).
- The paper's best runs shape without filtering (the two overlap), and verl's DAPO recipe ships
  shaping only: the dapo overlay turns shaping on (0.2, penalty 1) and leaves filtering off.
- Two-round rollouts (MTPO) have caps of their own (`mtpo.max_answer_length`,
  `max_confidence_length`), not `rollout.max_response_length`: refused (variants.py).

Metrics: overlong/shaped_fraction (responses inside the buffer), overlong/penalty_mean (mean over
all responses, <= 0) with shaping; overlong/filtered_fraction (responses masked out) with filtering.
"""

from __future__ import annotations

import torch

from aligner_ext.batch import ExperienceBatch
from aligner_ext.context import BuildContext
from aligner_ext.data.loader import PromptLoader
from aligner_ext.experience.base import (
    EXPERIENCE_WRAPPERS,
    ExperienceMaker,
    ExperienceWrapper,
    RolloutConfig,
    sparse_token_rewards,
)


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, penalty: float) -> torch.Tensor:
    """[B] float64 penalty (<= 0) of responses of `lengths` [B] tokens: penalty * R_length (module docstring)."""
    excess = lengths.to(torch.float64) - (max_length - buffer)
    return -penalty * (excess / buffer).clamp(min=0.0, max=1.0)


@EXPERIENCE_WRAPPERS.register("overlong")
class OverlongShaping(ExperienceWrapper):
    """Adds DAPO's soft overlong punishment to the rewards and / or masks truncated responses out of the loss."""

    reads = ("rewards", "token_rewards")

    def __init__(self, inner: ExperienceMaker, cfg: RolloutConfig):
        super().__init__(inner)
        self.cfg = cfg
        self.buffer = cfg.overlong_buffer_tokens()  # at least one token when on (RolloutConfig refuses 0)

    @classmethod
    def from_context(cls, inner: ExperienceMaker, ctx: BuildContext) -> ExperienceMaker:
        """The wrapper when shaping or filtering is on; otherwise `inner` untouched."""
        cfg = ctx.cfg.rollout
        if cfg.overlong_buffer_fraction == 0 and not cfg.overlong_filter:
            return inner
        return cls(inner, cfg)

    def make_experience(self, loader: PromptLoader, step: int) -> tuple[ExperienceBatch, dict[str, float]]:
        batch, metrics = self.inner.make_experience(loader, step)
        metrics.update(self.apply(batch))
        return batch, metrics

    def apply(self, batch: ExperienceBatch) -> dict[str, float]:
        """Shape `batch`'s rewards and mask its truncated responses, in place; returns the step's metrics."""
        metrics = {}
        if self.buffer:
            lengths = batch.response_lengths
            penalty = overlong_penalty(lengths, self.cfg.max_response_length, self.buffer, self.cfg.overlong_penalty)
            batch.rewards = (batch.rewards.to(torch.float64) + penalty).to(batch.rewards.dtype)
            batch.token_rewards = batch.token_rewards + sparse_token_rewards(penalty.float(), lengths,
                                                                             batch.token_rewards.shape[1])
            metrics["overlong/shaped_fraction"] = _mean(penalty < 0)
            metrics["overlong/penalty_mean"] = _mean(penalty)
        if self.cfg.overlong_filter:
            truncated = torch.tensor([sample.finish_reason == "length" for sample in batch.samples], dtype=torch.bool)
            batch.response_mask = batch.response_mask & ~truncated[:, None]
            metrics["overlong/filtered_fraction"] = _mean(truncated)
        return metrics


def _mean(values: torch.Tensor) -> float:
    """The mean of [B] values (a share, for flags); 0 for an empty batch."""
    return float(values.double().mean()) if values.numel() else 0.0
