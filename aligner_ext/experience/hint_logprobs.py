"""HintLogprobs: an experience wrapper that adds what CPO's advantage reads to the inner maker's batch.

After the inner maker returns its scored batch, one no-grad pass of the policy scores every
response under its prompt with the row's hint injected (`data/hints.py`), giving
`batch.hint_logprobs` [B, R] = log p(y_t | x, hint, y_<t) on the very same response tokens
(`batch.has_hint` marks the rows that got a hint). The plain log-probs and entropy come from the
loop's old-log-prob pass (`batch.old_logprobs`, `batch.entropy`), so no pass is run twice; the MI
metrics are therefore reported by the estimator (`algorithms/cpo.py`).

It also stores each group's `batch.difficulty` (`algorithms/cpo.py::difficulty`) and reports per
step the difficulty distribution over groups (`cpo/difficulty_*`) and hint counts and lengths
(`cpo/hint_*`).

It is listed in `algorithm.experience_wrappers` and turns itself on only when the advantage
estimator reads hint log-probs (`algorithm.adv_estimator=cpo`); otherwise it returns the inner maker
untouched. Listed outside a filtering wrapper (dynamic sampling), it runs on the kept groups only.
"""

from __future__ import annotations

import torch

from aligner_ext.algorithms.advantages import ADVANTAGES
from aligner_ext.algorithms.cpo import CPOConfig, difficulty, difficulty_metrics, outcomes
from aligner_ext.batch import ExperienceBatch
from aligner_ext.context import BuildContext
from aligner_ext.data.hints import hint_rows, hinted_batch, hinted_prompts
from aligner_ext.data.loader import PromptLoader
from aligner_ext.experience.base import EXPERIENCE_WRAPPERS, ExperienceMaker, ExperienceWrapper
from aligner_ext.models.base import Policy


@EXPERIENCE_WRAPPERS.register("hint_logprobs")
class HintLogprobs(ExperienceWrapper):
    """The inner maker's batch plus hint log-probs and group difficulty (CPO)."""

    def __init__(self, inner: ExperienceMaker, cfg: CPOConfig, gold_as_hint: bool, policy: Policy, tokenizer,
                 temperature: float):
        super().__init__(inner)
        self.cfg = cfg
        self.gold_as_hint = gold_as_hint
        self.policy = policy
        self.tokenizer = tokenizer
        self.temperature = temperature
        self.summary_metrics = (*inner.summary_metrics, "cpo/mi_mean", "cpo/mi_positive_fraction")  # from the estimator

    @classmethod
    def from_context(cls, inner: ExperienceMaker, ctx: BuildContext) -> ExperienceMaker:
        """The wrapper when the advantage estimator reads hint log-probs; otherwise `inner` untouched."""
        estimator = ADVANTAGES.get(ctx.cfg.algorithm.adv_estimator)
        if not getattr(estimator, "reads_hint_logprobs", False):
            return inner
        return cls(inner, ctx.cfg.cpo, ctx.cfg.algorithm.gold_as_hint, ctx.policy, ctx.tokenizer,
                   ctx.cfg.rollout.temperature)

    def make_experience(self, loader: PromptLoader, step: int) -> tuple[ExperienceBatch, dict[str, float]]:
        batch, metrics = self.inner.make_experience(loader, step)
        if len(batch) == 0:  # a filtering maker kept nothing: the loop skips the update
            return batch, metrics
        metrics.update(self.add_hint_pass(batch))
        correct, from_reward = outcomes(batch)
        batch.difficulty = difficulty(correct, batch.rewards, batch.group_ids, self.cfg)
        metrics.update(difficulty_metrics(batch.difficulty, batch.group_ids, self.cfg.difficulty))
        metrics["cpo/outcome_from_reward"] = float(from_reward)
        return batch, metrics

    def add_hint_pass(self, batch: ExperienceBatch) -> dict[str, float]:
        """Set hint_logprobs and has_hint on `batch`; return the hint metrics."""
        prompts = hinted_prompts(batch, self.tokenizer, self.cfg.hint, self.gold_as_hint)
        batch.has_hint = hint_rows(prompts)
        rows = torch.nonzero(batch.has_hint).flatten()
        batch.hint_logprobs = torch.zeros(batch.response_ids.shape, dtype=torch.float32)
        if len(rows):
            hinted = hinted_batch(batch.select(rows), [prompts.prompt_ids[i] for i in rows.tolist()],
                                  self.tokenizer.pad_token_id)
            batch.hint_logprobs[rows] = self.policy.logprobs(hinted, self.temperature)[0]
        lengths = prompts.hint_tokens
        return {
            "cpo/hint_rows": float(len(rows)),
            "cpo/hint_missing": float(prompts.num_missing),
            "cpo/hint_truncated": float(prompts.num_truncated),
            "cpo/hint_tokens_mean": sum(lengths) / len(lengths) if lengths else 0.0,
        }
