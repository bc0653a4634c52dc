"""verl's reward functions, used as they are.

verl's reward manager calls `compute_score(data_source=..., solution_str=..., ground_truth=...,
extra_info=...)` by keyword and reads a number, or a dict whose "score" is the reward (and "acc", where
given, whether the answer was right); its own scorers, which `default_compute_score` dispatches to, take
fewer: `gsm8k.compute_score(solution_str, ground_truth, method=..., format_score=..., score=...)`,
`math.compute_score(solution_str, ground_truth)`. Ours take `(response, row)`. `adapt` tells them apart
by parameter names: a function naming any of verl's arguments (VERL_ARGUMENTS) is called verl's way,
with the ones it names (all four when it takes **kwargs), so `+reward.sources.my_source=
verl.utils.reward_score.gsm8k:compute_score` needs no change to the function. A signature that is
neither (a parameter without a default that verl does not pass, or no way to receive the response) is
refused in one line when the reward resolves, before the model loads. The wrapper is a
`functools.partial` of module-level functions, so it pickles by reference into the reward workers as
any reward does.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from aligner_ext.data.types import PromptRow
from aligner_ext.rewards.base import RewardResult

VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")  # what verl passes, by keyword


class RewardSignatureError(TypeError):
    """A reward function takes neither our arguments nor verl's."""


def adapt(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as a reward of ours: unchanged if it takes `(response, row)`, wrapped if it takes verl's
    arguments by name; a RewardSignatureError (one line) if neither."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: not one of verl's Python reward functions
        return fn
    parameters = signature.parameters.values()
    takes_any_keyword = any(p.kind is p.VAR_KEYWORD for p in parameters)
    named = [p.name for p in parameters if p.name in VERL_ARGUMENTS and p.kind is not p.POSITIONAL_ONLY]
    ours = _takes_two_positionals(signature)
    if not named and (ours or not takes_any_keyword):  # a function of **kwargs alone is called verl's way
        if ours:
            return fn
        raise RewardSignatureError(f"{_label(fn, signature)} takes neither our arguments (response, row) nor verl's "
                                   f"({', '.join(VERL_ARGUMENTS)}, by name)")
    unfilled = [p.name for p in parameters if p.name not in named and p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if unfilled:
        raise RewardSignatureError(f"{_label(fn, signature)}: {', '.join(unfilled)} has no default and is none of the "
                                   f"arguments verl passes ({', '.join(VERL_ARGUMENTS)})")
    passed = VERL_ARGUMENTS if takes_any_keyword else tuple(named)
    if "solution_str" not in passed:
        raise RewardSignatureError(f"{_label(fn, signature)} takes no solution_str: it would never see the response")
    return functools.partial(call_verl_score, fn, passed)


def _takes_two_positionals(signature: inspect.Signature) -> bool:
    try:
        signature.bind("response", "row")
    except TypeError:
        return False
    return True


def _label(fn: Callable[..., Any], signature: inspect.Signature) -> str:
    return f"{getattr(fn, '__qualname__', type(fn).__name__)}{signature}"


def call_verl_score(fn: Callable[..., Any], passed: tuple[str, ...], response: str, row: PromptRow
                    ) -> RewardResult | float:
    """Call a verl reward function on one response, by keyword as verl does, with the arguments it takes
    (`passed`); a dict result gives its "score" (and "acc" as whether it was correct, the rest as logged info)."""
    arguments = {"data_source": row.data_source, "solution_str": response, "ground_truth": row.ground_truth,
                 "extra_info": row.extra_info}
    value = fn(**{name: arguments[name] for name in passed})
    if not isinstance(value, dict):
        return value
    if "score" not in value:
        raise ValueError(f"a verl reward function returned a dict without 'score' (keys: {sorted(value)})")
    info = {key: item for key, item in value.items() if key not in ("score", "acc")}
    correct = value.get("acc")
    return RewardResult(score=float(value["score"]), correct=None if correct is None else float(correct), info=info)
