"""Math reward through math-verify: 1.0 if the response's answer equals the ground truth, else 0.0.

    gold = parse(ground_truth wrapped as `$...$`);  pred = parse(response, boxed answers first)
    score = correct = 1.0 if verify(gold, pred) else 0.0

Decisions:
- `verify` is asymmetric; the gold goes first, as math-verify requires.
- A bare ground truth such as `19` or `\\frac{1}{2}` is wrapped in `$...$` so the LaTeX extractor
  finds it; one already holding `$`, `\\(`, `\\[` or `\\boxed` is parsed as it is.
- The prediction prefers the last `\\boxed{...}` (`boxed_match_priority=0`), then math-verify's
  "final answer is" patterns and the last expression; a response with no answer scores 0.0.
- math-verify's own time limits use `signal.alarm`, which fails outside the main thread; they are
  off (`parsing_timeout=None`, `timeout_seconds=None`) and `RewardManager` enforces the limit by
  killing the worker process. The warning math-verify logs about this is filtered out.
- A missing or unparseable ground truth raises (the manager counts and logs it as an error).
"""

from __future__ import annotations

import logging

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from aligner_ext.data.types import PromptRow
from aligner_ext.rewards.base import RewardResult, register_reward

MATH_DATA_SOURCES = (
    "arithmetic", "math", "MATH", "gsm8k", "openai/gsm8k", "hendrycks_math", "math500", "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math_dapo", "aime2024", "aime2025", "amc23",
)
_GOLD_CONFIG = (LatexExtractionConfig(), ExprExtractionConfig())
_PRED_CONFIG = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")


class _NoTimeoutWarning(logging.Filter):
    """Drop math-verify's 'Timeout is disabled' warning: the manager enforces the time limit."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


logging.getLogger("math_verify.parser").addFilter(_NoTimeoutWarning())
logging.getLogger("math_verify.grader").addFilter(_NoTimeoutWarning())


def parse_gold(ground_truth: object) -> list:
    """math-verify's parse of a ground truth; raise if it is missing or has no parseable answer."""
    if ground_truth is None:
        raise ValueError("no ground_truth to compare with")
    text = str(ground_truth).strip()
    gold = parse(text if any(d in text for d in _DELIMITERS) else f"${text}$",
                 extraction_config=_GOLD_CONFIG, parsing_timeout=None)
    if not gold:
        raise ValueError(f"ground_truth {ground_truth!r} has no answer math-verify can parse")
    return gold


@register_reward("math_verify", data_sources=MATH_DATA_SOURCES)
def math_verify_reward(response: str, row: PromptRow) -> RewardResult:
    """1.0 if math-verify finds the response's answer equal to the ground truth, else 0.0."""
    gold = parse_gold(row.ground_truth)
    pred = parse(response, extraction_config=_PRED_CONFIG, parsing_timeout=None)
    ok = bool(pred) and verify(gold, pred, timeout_seconds=None)
    return RewardResult(score=float(ok), correct=float(ok), info={"answer": str(pred[-1]) if pred else None})
