"""Math reward through math-verify: 1.0 if the response's answer equals the ground truth, else 0.0.

    gold = parse(ground_truth wrapped as `$...$`);  pred = parse(response, boxed answers first)
    score = correct = 1.0 if verify(gold, pred) else 0.0

Decisions:
- `verify` is asymmetric; the gold goes first, as math-verify requires.
- A bare ground truth such as `19` or `\\frac{1}{2}` is wrapped in `$...$` so the LaTeX extractor
  finds it; one already holding `$`, `\\(`, `\\[` or `\\boxed` is parsed as it is.
- `math_verify` (the default for math data sources) takes the prediction only from LaTeX the
  response marks as math, the last `\\boxed{...}` first (`boxed_match_priority=0`); a response with
  no marked answer scores 0.0. Plain-expression extraction is left out on purpose: it evaluates any
  expression, so answering "12+1=" with "12+1" scored 1.0 (seen in the embedded demo on a GPU).
  `math_verify_lenient` adds it back, for data whose answers are plain numbers ("#### 42").
- math-verify's own time limits use `signal.alarm`, which fails outside the main thread; they are
  off (`parsing_timeout=None`, `timeout_seconds=None`) and `RewardManager` enforces the limit by
  killing the worker process. The warning math-verify logs about this is filtered out.
- A missing or unparseable ground truth raises (the manager counts and logs it as an error).
- The answer reported for majority voting (`RewardResult.answer`) is math-verify's parse of the
  prediction as sympy prints it: `\\frac{1}{2}`, `\\frac12`, `2/4` and `0.5` all vote `1/2`, but
  expressions sympy leaves in different forms, `(x+1)^2` and `x^2+2x+1`, are different votes.
- GSM8K (`gsm8k`, the default for `gsm8k` and `openai/gsm8k` rows): the answer is the number after
  the last `####`, as GSM8K's own solutions and verl's gsm8k reward write it, else the boxed answer;
  a ground truth holding a whole GSM8K solution is read the same way.
"""

from __future__ import annotations

import logging
import re

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from aligner_ext.data.types import PromptRow
from aligner_ext.rewards.base import RewardResult, register_reward

MATH_DATA_SOURCES = (
    "arithmetic", "calculator_arithmetic", "chain_sums", "three_digit_sums", "mixed_arithmetic", "python_digits",
    "math", "MATH", "hendrycks_math", "math500", "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math_dapo", "aime2024", "aime2025", "amc23",
)
_GOLD_CONFIG = (LatexExtractionConfig(), ExprExtractionConfig())
_PRED_CONFIG = (LatexExtractionConfig(boxed_match_priority=0),)
_LENIENT_PRED_CONFIG = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")


class _NoTimeoutWarning(logging.Filter):
    """Drop math-verify's 'Timeout is disabled' warning: the manager enforces the time limit."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


logging.getLogger("math_verify.parser").addFilter(_NoTimeoutWarning())
logging.getLogger("math_verify.grader").addFilter(_NoTimeoutWarning())


_HASHES_ANSWER = re.compile(r"####\s*\$?\s*([-+]?[\d,]*\.?\d+)")


def after_hashes(text: str) -> str | None:
    """The number after the last `####` in `text` (thousands separators dropped), or None."""
    found = _HASHES_ANSWER.findall(text)
    return found[-1].replace(",", "") if found else None


def parse_gold(ground_truth: object) -> list:
    """math-verify's parse of a ground truth; raise if it is missing or has no parseable answer."""
    if ground_truth is None:
        raise ValueError("no ground_truth to compare with")
    text = str(ground_truth).strip()
    text = after_hashes(text) or text
    gold = parse(text if any(d in text for d in _DELIMITERS) else f"${text}$",
                 extraction_config=_GOLD_CONFIG, parsing_timeout=None)
    if not gold:
        raise ValueError(f"ground_truth {ground_truth!r} has no answer math-verify can parse")
    return gold


def _verify(response: str, row: PromptRow, pred_config: tuple) -> RewardResult:
    gold = parse_gold(row.ground_truth)
    pred = parse(response, extraction_config=pred_config, parsing_timeout=None)
    ok = bool(pred) and verify(gold, pred, timeout_seconds=None)
    return RewardResult(score=float(ok), correct=float(ok), info={"answer": str(pred[-1]) if pred else None},
                        answer=str(pred[0]) if pred else None)


@register_reward("math_verify", data_sources=MATH_DATA_SOURCES, extracts_answer=True)
def math_verify_reward(response: str, row: PromptRow) -> RewardResult:
    """1.0 if the response's marked (boxed / LaTeX) answer equals the ground truth, else 0.0."""
    return _verify(response, row, _PRED_CONFIG)


@register_reward("gsm8k", data_sources=("gsm8k", "openai/gsm8k"), extracts_answer=True)
def gsm8k_reward(response: str, row: PromptRow) -> RewardResult:
    """1.0 if the number after the response's last `####` (else its boxed answer) equals the ground truth."""
    answer = after_hashes(response)
    return _verify(f"${answer}$" if answer is not None else response, row, _PRED_CONFIG)


@register_reward("math_verify_lenient", extracts_answer=True)
def math_verify_lenient_reward(response: str, row: PromptRow) -> RewardResult:
    """As `math_verify`, but a plain number or expression in the response also counts as its answer."""
    return _verify(response, row, _LENIENT_PRED_CONFIG)
