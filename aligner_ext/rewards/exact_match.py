"""String-equality rewards: `exact_match` (light normalisation) and `squad_exact_match` (SQuAD's).

The answer is the content of the last complete `\\boxed{...}` if there is one, else of the last
`<answer>...</answer>`, else the whole response. The ground truth is a string (or number), or a list
of acceptable answers; the score is 1.0 if the answer equals any of them after normalisation.

- `normalize_text` (exact_match): strip, lower-case, collapse whitespace, drop one trailing period.
- `normalize_answer` (squad_exact_match): the SQuAD v1.1 evaluation script's normalisation:
  lower-case, drop punctuation, drop the articles a/an/the, collapse whitespace.
"""

from __future__ import annotations

import re
import string
from typing import Any, Callable

from aligner_ext.data.types import PromptRow
from aligner_ext.rewards.base import RewardResult, register_reward
from aligner_ext.rewards.format import last_boxed

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)


def extract_answer(response: str) -> str:
    """The last boxed content, else the last <answer> tag's content, else the whole response."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    tags = _ANSWER_TAG.findall(response)
    return tags[-1] if tags else response


def normalize_text(text: str) -> str:
    """Strip, lower-case, collapse whitespace, drop a trailing period: ' The  Cat. ' -> 'the cat'."""
    text = " ".join(text.lower().split())
    return text[:-1].rstrip() if text.endswith(".") else text


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: 'The  Cat, sat!' -> 'cat sat'."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _golds(row: PromptRow) -> list[str]:
    """The acceptable answers of a row; a row without ground_truth is an error."""
    gold: Any = row.ground_truth
    if gold is None:
        raise ValueError("no ground_truth to compare with")
    return [str(g) for g in gold] if isinstance(gold, (list, tuple)) else [str(gold)]


def _match(response: str, row: PromptRow, normalize: Callable[[str], str]) -> RewardResult:
    answer = normalize(extract_answer(response))
    ok = any(answer == normalize(gold) for gold in _golds(row))
    return RewardResult(score=float(ok), correct=float(ok), info={"answer": answer}, answer=answer)


@register_reward("exact_match", extracts_answer=True)
def exact_match_reward(response: str, row: PromptRow) -> RewardResult:
    """1.0 if the extracted answer equals the ground truth after `normalize_text`, else 0.0."""
    return _match(response, row, normalize_text)


@register_reward("squad_exact_match", data_sources=("short_qa",), extracts_answer=True)
def squad_exact_match_reward(response: str, row: PromptRow) -> RewardResult:
    """1.0 if the extracted answer equals the ground truth after `normalize_answer`, else 0.0."""
    return _match(response, row, normalize_answer)
