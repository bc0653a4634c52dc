"""verl's reward functions, used as they are.

verl calls `compute_score(data_source, solution_str, ground_truth, extra_info)` and reads a number, or
a dict whose "score" is the reward (and "acc", where given, whether the answer was right). Ours take
`(response, row)`. `adapt` recognises verl's signature by its parameter names and wraps the function
so the reward manager calls it ours way: `+reward.sources.my_source=my_pkg.rewards:compute_score`
needs no change to the function. The wrapper is a `functools.partial` of module-level functions, so
it pickles by reference into the reward workers as any reward does.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from aligner_ext.data.types import PromptRow
from aligner_ext.rewards.base import RewardResult

VERL_PARAMETERS = ("data_source", "solution_str", "ground_truth")  # verl's first three, by name


def _parameters(fn: Callable[..., Any]) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin or C function: not one of verl's Python reward functions
        return {}


def is_verl_signature(fn: Callable[..., Any]) -> bool:
    """Whether `fn` takes verl's arguments (data_source, solution_str, ground_truth[, extra_info])."""
    return tuple(_parameters(fn))[:3] == VERL_PARAMETERS


def adapt(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` as a reward of ours: wrapped if it has verl's signature, else unchanged."""
    parameters = _parameters(fn)
    if tuple(parameters)[:3] != VERL_PARAMETERS:
        return fn
    takes_extra_info = "extra_info" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    return functools.partial(call_verl_score, fn, takes_extra_info)


def call_verl_score(fn: Callable[..., Any], takes_extra_info: bool, response: str, row: PromptRow
                    ) -> RewardResult | float:
    """Call a verl reward function on one response, by keyword as verl does (`extra_info` where it takes
    it); a dict result gives its "score" (and "acc" as whether it was correct, the rest as logged info)."""
    arguments = {"data_source": row.data_source, "solution_str": response, "ground_truth": row.ground_truth}
    if takes_extra_info:
        arguments["extra_info"] = row.extra_info
    value = fn(**arguments)
    if not isinstance(value, dict):
        return value
    if "score" not in value:
        raise ValueError(f"a verl reward function returned a dict without 'score' (keys: {sorted(value)})")
    info = {key: item for key, item in value.items() if key not in ("score", "acc")}
    correct = value.get("acc")
    return RewardResult(score=float(value["score"]), correct=None if correct is None else float(correct), info=info)
