"""MTPO segment advantages: answers are compared within their prompt, confidences within their answer.

A prompt p has G round-1 answers a; each answer has H round-2 confidence continuations k, so the
batch holds G * H samples of p (experience/two_round.py). With R_ans(a) the answer-side reward and
R_conf(k) the confidence-side reward (rewards/calibration.py):

    A_ans(a)  = (R_ans(a)  - mean_{a' of p} R_ans)  / max(std_{a' of p} R_ans,  std_floor)   over the G answers
    A_conf(k) = (R_conf(k) - mean_{k' of a} R_conf) / max(std_{k' of a} R_conf, std_floor)   over the H continuations
    A_t       = A_ans  on round-1 tokens (segment 0)  and  A_conf on round-2 tokens (segment 1),
                both only where response_mask is True

(without the std division when `advantage.use_std` is false: the original recipe's `scale_rewards: false`).
Source: the MTPO description in the RLCR fork (`MTPO.md`; reference notes, section 2.2).

Decisions (docs/variants/mtpo.md; tests/unit/algorithms/test_mtpo_advantages.py pins them):
- The answer baseline is over the G answers, one value per answer, not over the G * H rows that
  repeat it (reference notes 7.6: the public description says the G answers). Its mean is the
  same either way when every answer has H rows, but the unbiased std is not: over G * H copies
  it is sqrt(H (G - 1) / (G H - 1)) times the std over the G answers. The reward of an answer is
  read from its rows, which must all agree (an error names the answer otherwise).
- All G answers form the baseline, unclosed ones included (they carry reward 0); the fork's STPO
  code centres over format-valid answers only, which we do not follow.
- Group statistics are those of GRPO (`group_baseline_normalize`): unbiased std, floor applied as
  max(std, floor), float64, groups whose rewards all agree get exactly 0.
- Which round-1 tokens count at all (the first-confidence-only rule) is decided by the experience
  maker through `response_mask`, so the advantage and every loss denominator see the same tokens.
"""

from __future__ import annotations

import torch

from aligner_ext.algorithms.advantages import ADVANTAGES, GroupAdvantage, group_baseline_normalize
from aligner_ext.batch import ANSWER_SEGMENT, ExperienceBatch
from aligner_ext.context import BuildContext
from aligner_ext.groups import first_rows, group_stats


def answer_advantages(answer_rewards: torch.Tensor, group_ids: torch.Tensor, answer_group_ids: torch.Tensor,
                      use_std: bool, std_floor: float) -> torch.Tensor:
    """[B] float64: A_ans of each sample's answer, normalised over the distinct answers of its prompt.

    Args:
        answer_rewards: [B] R_ans, equal on all rows of one answer.
        group_ids: [B] prompt group of each row.
        answer_group_ids: [B] answer of each row (nested in the prompt groups).
    """
    row_answer, first_row = first_rows(answer_group_ids)
    per_answer = answer_rewards[first_row]
    disagree = answer_rewards != per_answer[row_answer]
    prompt_mismatch = group_ids != group_ids[first_row][row_answer]
    for name, bad in (("answer reward", disagree), ("prompt group id", prompt_mismatch)):
        if bad.any():
            answer = int(answer_group_ids[bad.nonzero()[0, 0]])
            raise ValueError(f"rows of answer group {answer} differ in their {name}; an answer must have one")
    per_answer_adv = group_baseline_normalize(per_answer, group_ids[first_row], use_std, std_floor)
    return per_answer_adv[row_answer]


@ADVANTAGES.register("mtpo_segments", "mtpo")
class MTPOAdvantage:
    """A_ans on round-1 tokens (baseline per prompt), A_conf on round-2 tokens (baseline per answer)."""

    Config = GroupAdvantage.Config
    reads = ("answer_rewards", "confidence_rewards", "answer_group_ids", "segment_ids")

    def __init__(self, cfg: GroupAdvantage.Config):
        if cfg.std_floor <= 0:
            raise ValueError(f"advantage.std_floor must be > 0, got {cfg.std_floor}")
        self.cfg = cfg
        self._metrics: dict[str, float] = {}

    @classmethod
    def from_context(cls, ctx: BuildContext) -> "MTPOAdvantage":
        return cls(ctx.cfg.advantage)

    def __call__(self, batch: ExperienceBatch) -> torch.Tensor:
        """[B, R] float32: A_ans on masked-in round-1 tokens, A_conf on masked-in round-2 tokens, 0 elsewhere."""
        use_std, floor = self.cfg.use_std, self.cfg.std_floor
        a_ans = answer_advantages(batch.answer_rewards, batch.group_ids, batch.answer_group_ids, use_std, floor)
        a_conf = group_baseline_normalize(batch.confidence_rewards, batch.answer_group_ids, use_std, floor)
        per_token = torch.where(batch.segment_ids == ANSWER_SEGMENT, a_ans[:, None], a_conf[:, None])
        _, first = first_rows(batch.answer_group_ids)
        answers = group_stats(batch.answer_rewards[first], batch.group_ids[first])
        confidences = group_stats(batch.confidence_rewards, batch.answer_group_ids)
        self._metrics = {  # groups whose rewards all agree carry no signal for their segment
            "mtpo/answer_zero_std_fraction": float(answers.all_agree(0.0).double().mean()),
            "mtpo/confidence_zero_std_fraction": float(confidences.all_agree(0.0).double().mean()),
        }
        return (per_token * batch.response_mask).to(torch.float32)

    def metrics(self) -> dict[str, float]:
        """Of the last call: fractions of prompt groups (answers) and answer groups (confidences) with no spread."""
        return dict(self._metrics)
