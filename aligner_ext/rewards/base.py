"""What a reward function is, and the tables that find one for a row.

A reward function is a module-level function `fn(response: str, row: PromptRow) -> RewardResult | float`.
It must be module-level (picklable by reference) because `RewardManager` runs it in worker processes.
A plain number is read as `RewardResult(score=value, correct=None)`.

A function that extracts an answer from the response and compares it declares so
(`register_reward(..., extracts_answer=True)`, or `fn.extracts_answer = True` on a function of your
own) and reports it in `RewardResult.answer`: the held-out majority vote (maj@k,
trainer/evaluate.py) counts responses by it. The answer is extracted in the worker, under the call's
time limit, as the score is.

Two tables:
- `REWARDS`: reward name -> function; a name that is not registered but contains a dot is imported
  as `pkg.module:fn`, so user functions plug in without registering.
- `DATA_SOURCES`: data_source -> reward name, filled by `register_reward(..., data_sources=...)`
  beside each built-in function; `RewardConfig.sources` overrides it per run.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

from aligner_ext.registry import Registry

REWARDS = Registry("reward function")
DATA_SOURCES: dict[str, str] = {}


@dataclass
class RewardResult:
    """The outcome of scoring one response."""

    score: float  # the reward the policy is trained on
    correct: float | None = None  # raw outcome 1.0 / 0.0 before any shaping; None: no notion of correctness
    info: dict[str, Any] = field(default_factory=dict)  # what the function wants logged (extracted answer, ...)
    answer: str | None = None  # the extracted answer as compared (normalised), what maj@k votes on; None: none found


def register_reward(name: str, *aliases: str, data_sources: tuple[str, ...] = (),
                    extracts_answer: bool = False) -> Callable[[Any], Any]:
    """Register a reward function under `name` (and aliases) and make it the default for `data_sources`;
    `extracts_answer`: it reports the answer it compared in `RewardResult.answer`."""

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        REWARDS.register(name, *aliases)(fn)
        if extracts_answer:
            fn.extracts_answer = True
        for source in data_sources:
            if DATA_SOURCES.get(source, name) != name:
                raise ValueError(f"data_source {source!r} is mapped to both {DATA_SOURCES[source]!r} and {name!r}")
            DATA_SOURCES[source] = name
        return fn

    return decorator


def as_result(value: Any) -> RewardResult:
    """Read a reward function's return value; raise on anything but a RewardResult or a finite number."""
    if isinstance(value, RewardResult):
        result = value
    elif isinstance(value, numbers.Real):
        result = RewardResult(score=float(value))
    else:
        raise TypeError(f"reward function returned {type(value).__name__}; expected RewardResult or float")
    if not is_trainable_score(result.score):
        raise ValueError(f"reward function returned score {result.score!r}; expected a finite number within "
                         f"float32's range (|score| <= {FLOAT32_MAX:.3g}), as rewards are trained in float32")
    return result


FLOAT32_MAX = 3.4028234663852886e38


def is_trainable_score(value: Any) -> bool:
    """A real number that stays finite in float32 (rewards become float32 tensors)."""
    return isinstance(value, numbers.Real) and math.isfinite(value) and abs(value) <= FLOAT32_MAX
