"""Segment rewards of MTPO two-round rollouts: what the answer and the confidence each earn.

A two-round completion is round 1 `<think>...</think><answer>...</answer>` followed by round 2
`<analysis>...</analysis><confidence>c</confidence>`. The experience maker knows where the rounds
meet from the token ids, so each function here gets the text of its own segment, never a split
guessed from the whole text. With y the answer's correctness (1 / 0):

    answer side      R_ans  = correctness_weight * score(answer) + answer_format_weight * F_ans(answer)
    confidence side  R_conf = calibration_weight * (1 - (c - y)^2) + confidence_format_weight * F_conf(conf)

`score` and y come from the row's own reward function (the reward registry, by data_source; for
QA `squad_exact_match`), called by the experience maker through the RewardManager. 1 - (c - y)^2
is the Brier score turned into a reward: a bounded proper scoring rule, maximised in expectation
by the true probability of being right (RLCR, Damani et al. 2025, arXiv 2507.16806).

Decisions (docs/variants/mtpo.md; tests/unit/rewards/test_mtpo_calibration.py pins them):
- An unparseable confidence earns calibration 0, the lowest value 1 - (c - y)^2 can take, as in
  RLCR's `brier` reward. Parseable means: the content of the last `<confidence>...</confidence>` of
  the round-2 text is a float in [0, 1] (`parse_confidence`); "70%", "0.7!", "nan" and 1.5 are not.
- A round-1 completion without its closing `</answer>` (cut at the length cap, or ended by EOS) is
  an invalid answer: every answer-side term is 0 (the row's reward function is not asked, so no
  text outside an answer tag can be matched), no round 2 is generated, and R_conf = 0.
- Format checks are case-sensitive (the stop strings are too) and allow only whitespace around
  the tags. `format_answer_segment` requires `<think>` and `<answer>`; `format_confidence_segment`
  requires `<analysis>` before the confidence (the original recipe's format line), while
  `format_confidence_segment_lenient` makes it optional (the public MTPO fork's regex). Which one
  applies is the config's `confidence_format` (a reward name, so a user function plugs in too).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from aligner_ext.data.types import PromptRow
from aligner_ext.rewards.base import REWARDS, RewardResult, as_result, register_reward
from aligner_ext.rewards.exact_match import squad_exact_match_reward
from aligner_ext.rewards.settings import SegmentRewardsConfig

_ANSWER_SEGMENT = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
_CONFIDENCE_SEGMENT = re.compile(r"\s*<analysis>.*?</analysis>\s*<confidence>[^<]*</confidence>\s*", re.DOTALL)
_CONFIDENCE_SEGMENT_LENIENT = re.compile(
    r"\s*(?:<analysis>.*?</analysis>\s*)?<confidence>[^<]*</confidence>\s*", re.DOTALL)
_CONFIDENCE_TAG = re.compile(r"<confidence>(.*?)</confidence>", re.DOTALL)
_FLOAT = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")

# HotpotQA rows (data/hotpotqa.py; RLCR's data source is `hotpot`) are graded like SQuAD: normalised exact match.
register_reward("squad_exact_match", data_sources=("hotpotqa", "hotpot"))(squad_exact_match_reward)


def parse_confidence(text: str) -> float | None:
    """The last `<confidence>` value of `text` if it is a plain float in [0, 1], else None."""
    tags = _CONFIDENCE_TAG.findall(text)
    if not tags:
        return None
    value = tags[-1].strip()
    if not _FLOAT.fullmatch(value):
        return None
    number = float(value)
    return number if 0.0 <= number <= 1.0 else None


def calibration_reward(confidence: float | None, correct: float) -> float:
    """1 - (c - y)^2 for a parsed confidence c and correctness y in {0, 1}; 0 when c is None."""
    if confidence is None:
        return 0.0
    return 1.0 - (confidence - correct) ** 2


@register_reward("format_answer_segment")
def format_answer_segment(response: str, row: PromptRow) -> RewardResult:
    """1.0 when the round-1 text is exactly `<think>...</think><answer>...</answer>` (whitespace around)."""
    return RewardResult(score=float(_ANSWER_SEGMENT.fullmatch(response) is not None))


@register_reward("format_confidence_segment")
def format_confidence_segment(response: str, row: PromptRow) -> RewardResult:
    """1.0 when the round-2 text is `<analysis>...</analysis><confidence>c</confidence>`, c in [0, 1]."""
    ok = _CONFIDENCE_SEGMENT.fullmatch(response) is not None and parse_confidence(response) is not None
    return RewardResult(score=float(ok))


@register_reward("format_confidence_segment_lenient")
def format_confidence_segment_lenient(response: str, row: PromptRow) -> RewardResult:
    """As `format_confidence_segment`, with the `<analysis>` block optional."""
    ok = _CONFIDENCE_SEGMENT_LENIENT.fullmatch(response) is not None and parse_confidence(response) is not None
    return RewardResult(score=float(ok))


@dataclass(frozen=True)
class SegmentScore:
    """The reward terms of one two-round sample."""

    answer_reward: float  # R_ans
    confidence_reward: float  # R_conf
    answer_format: float  # F_ans in [0, 1]
    confidence_format: float  # F_conf in [0, 1]
    confidence: float | None  # parsed confidence, None when unparseable or absent
    calibration: float  # 1 - (c - y)^2, or 0


class SegmentRewards:
    """Weights the answer-side and confidence-side terms (see the module docstring)."""

    Config = SegmentRewardsConfig  # its settings (aligner_ext/rewards/settings.py)

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.answer_format_fn = REWARDS.get(cfg.answer_format)
        self.confidence_format_fn = REWARDS.get(cfg.confidence_format)

    def score(self, row: PromptRow, answer_text: str, answer_score: float | None, correct: float,
              confidence_text: str | None) -> SegmentScore:
        """Terms of one sample.

        Args:
            answer_score: the row's reward for the answer; None marks an invalid answer (round 1
                without its closing answer tag): then every term is 0.
            correct: the answer's correctness y (1 / 0).
            confidence_text: the round-2 text; None when there was no round 2.
        """
        if answer_score is None:
            return SegmentScore(0.0, 0.0, 0.0, 0.0, None, 0.0)
        cfg = self.cfg
        answer_format = _checked(self.answer_format_fn, answer_text, row, cfg.answer_format)
        text = confidence_text or ""
        confidence = parse_confidence(text)
        confidence_format = _checked(self.confidence_format_fn, text, row, cfg.confidence_format)
        calibration = calibration_reward(confidence, correct)
        return SegmentScore(
            answer_reward=cfg.correctness_weight * answer_score + cfg.answer_format_weight * answer_format,
            confidence_reward=cfg.calibration_weight * calibration + cfg.confidence_format_weight * confidence_format,
            answer_format=answer_format, confidence_format=confidence_format, confidence=confidence,
            calibration=calibration,
        )


def _checked(fn, text: str, row: PromptRow, name: str) -> float:
    """A format function's score, required to lie in [0, 1]."""
    score = as_result(fn(text, row)).score
    if not 0.0 <= score <= 1.0:
        raise ValueError(f"format reward {name!r} returned {score} for row {row.row_id}; expected a value in [0, 1]")
    return score
