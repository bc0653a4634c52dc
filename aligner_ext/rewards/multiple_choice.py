"""Multiple-choice reward: the chosen letter (A-J) against the ground-truth letter.

The letter is taken from the first of these that is present (the last occurrence within each):
1. the last `\\boxed{...}`, whose content must be one letter once `\\text{}`, `\\textbf{}`, brackets
   and a trailing period are removed: `\\boxed{B}`, `\\boxed{(b)}`, `\\boxed{\\text{B}}`;
2. an answer phrase: `Answer: B`, `the answer is (B)`, `answer: **B**` (not `Answer: Apple`);
3. a capital letter, bracketed or alone, at the very end: `... so (B).`, `B`.
Only inside `\\boxed{}` does a lower-case letter count (elsewhere "a" is a word). A response with none
of these scores 0.0. The ground truth must be one letter A-J (brackets and case are ignored),
otherwise the call is an error (counted by the manager).
"""

from __future__ import annotations

import re

from aligner_ext.data.types import PromptRow
from aligner_ext.rewards.base import RewardResult, register_reward
from aligner_ext.rewards.format import last_boxed

_LETTER = re.compile(r"[\s(\[{*]*([A-Ja-j])[\s)\]}*.]*")
_TEXT_WRAPPER = re.compile(r"\\text(?:bf|rm)?\{([^{}]*)\}")
_ANSWER_PHRASE = re.compile(r"(?i:answer)(?:\s+is)?\s*[:：]?\s*[(\[*]*([A-J])(?![A-Za-z])")
_AT_END = re.compile(r"(?:^|[\s(\[*])\(?([A-J])\)?[*.]*\s*$")


def extract_choice(response: str) -> str | None:
    """The chosen letter, upper-case, or None."""
    boxed = last_boxed(response)
    if boxed is not None:
        letter = _LETTER.fullmatch(_TEXT_WRAPPER.sub(r"\1", boxed))
        return letter.group(1).upper() if letter else None
    phrases = _ANSWER_PHRASE.findall(response)
    if phrases:
        return phrases[-1]
    end = _AT_END.search(response)
    return end.group(1) if end else None


@register_reward("multiple_choice", data_sources=("multiple_choice", "gpqa"), extracts_answer=True)
def multiple_choice_reward(response: str, row: PromptRow) -> RewardResult:
    """1.0 if the chosen letter is the ground-truth letter, else 0.0."""
    gold = _LETTER.fullmatch(str(row.ground_truth))
    if gold is None:
        raise ValueError(f"ground_truth {row.ground_truth!r} is not one letter A-J")
    choice = extract_choice(response)
    ok = choice == gold.group(1).upper()
    return RewardResult(score=float(ok), correct=float(ok), info={"choice": choice}, answer=choice)
