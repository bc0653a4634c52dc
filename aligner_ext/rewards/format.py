"""Where a `\\boxed{...}` answer sits in a response, and a format reward built on it.

`boxed_spans` finds every complete `\\boxed{...}` with brace matching (the content may hold nested
braces, e.g. `\\boxed{\\frac{1}{2}}`); an unclosed one is not an answer. The other reward functions
take their answer from the last span.

`format_boxed` scores 1.0 when the response has exactly one complete `\\boxed{...}` and at most
`MAX_TRAILING_CHARS` non-space characters after it (room for `$.`, `\\]` or `</answer>`, not for a
second attempt), else 0.0. It has no notion of correctness (`correct=None`).
"""

from __future__ import annotations

import re

from aligner_ext.data.types import PromptRow
from aligner_ext.rewards.base import RewardResult, register_reward

MAX_TRAILING_CHARS = 20  # non-space characters allowed after the boxed answer
_BOXED = re.compile(r"\\boxed\s*\{")


def boxed_spans(text: str) -> list[tuple[int, int, str]]:
    """Every complete `\\boxed{...}` in `text` as (start, end, content), in order; end is exclusive."""
    spans = []
    for match in _BOXED.finditer(text):
        depth = 1
        for pos in range(match.end(), len(text)):
            depth += {"{": 1, "}": -1}.get(text[pos], 0)
            if depth == 0:
                spans.append((match.start(), pos + 1, text[match.end():pos]))
                break
    return spans


def last_boxed(text: str) -> str | None:
    """Content of the last complete `\\boxed{...}`, or None if there is none."""
    spans = boxed_spans(text)
    return spans[-1][2] if spans else None


@register_reward("format_boxed")
def format_boxed_reward(response: str, row: PromptRow) -> RewardResult:
    """1.0 for exactly one boxed answer at the end of the response, else 0.0."""
    spans = boxed_spans(response)
    trailing = "".join(response[spans[-1][1]:].split()) if spans else ""
    ok = len(spans) == 1 and len(trailing) <= MAX_TRAILING_CHARS
    return RewardResult(score=float(ok), info={"num_boxed": len(spans)})
