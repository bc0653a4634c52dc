"""Dynamic sampling's group filters: a predicate on the rows of one prompt group that says whether
to keep the group and why.

Each filter returns `FilterResult(keep, reason)` (slime's filter_hub idea); the wrapper
(experience/dynamic_sampling.py) counts every reason into a `dynamic_sampling/<kept|dropped>_<reason>`
metric, so no group vanishes unexplained. `dynamic_sampling.filter_metric` names the filter:

| name | keeps a group when | metrics |
| --- | --- | --- |
| correct | its raw outcomes (`correct`) spread by more than eps | dropped_all_correct, dropped_all_wrong |
| seq_reward | its sums of token-level scores spread by more than eps | dropped_all_correct, dropped_all_wrong |
| segments | MTPO: its answers' rewards spread, or the confidence rewards of one of its answers do | kept_answer_spread, kept_confidence_only, dropped_segments_agree |

"Spread" is max - min > eps (the negation of `GroupStats.all_agree`, which the CPO difficulty mask uses).
The segment filter judges each segment by the rewards MTPO's advantage normalises
(algorithms/mtpo.py): the answer rewards over the group's G answers, the confidence rewards over
the H continuations of each answer. A group whose answers all agree still trains its confidence
tokens when one answer's confidences differ, so it is kept (`kept_confidence_only` counts the
groups an answer-level filter would have dropped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from aligner_ext.batch import ExperienceBatch
from aligner_ext.errors import ConfigError
from aligner_ext.groups import first_rows, group_stats


@dataclass(frozen=True)
class FilterResult:
    """The verdict on one group."""

    keep: bool
    reason: str | None  # counted as kept_<reason> / dropped_<reason>; None: a keep not worth a metric


@dataclass(frozen=True)
class GroupFilter:
    """A predicate over one group's rows, the metrics its reasons produce and the batch fields it reads."""

    predicate: Callable[[ExperienceBatch, float], FilterResult]
    metrics: tuple[str, ...]  # every kept_<reason> / dropped_<reason> it can produce, reported each step
    reads: tuple[str, ...]  # ExperienceBatch fields the predicate needs


def _spread(values: torch.Tensor, eps: float) -> bool:
    values = values.to(torch.float64)
    return float(values.max() - values.min()) > eps


def _outcome_verdict(outcome: torch.Tensor, eps: float) -> FilterResult:
    """Keep a mixed group; a dropped one is all correct when its common value is > 0.5."""
    if _spread(outcome, eps):
        return FilterResult(True, None)
    return FilterResult(False, "all_correct" if float(outcome[0]) > 0.5 else "all_wrong")


def correct_spread(group: ExperienceBatch, eps: float) -> FilterResult:
    if torch.isnan(group.correct).any():
        raise ConfigError("dynamic_sampling.filter_metric=correct needs reward functions that report "
                          "correctness; set dynamic_sampling.filter_metric=seq_reward for these data sources")
    return _outcome_verdict(group.correct, eps)


def seq_reward_spread(group: ExperienceBatch, eps: float) -> FilterResult:
    return _outcome_verdict(group.token_rewards.sum(dim=1), eps)


def segment_spread(group: ExperienceBatch, eps: float) -> FilterResult:
    """Keep when the answer rewards (one per answer) or one answer's confidence rewards spread."""
    _, first = first_rows(group.answer_group_ids)
    if _spread(group.answer_rewards[first], eps):
        return FilterResult(True, "answer_spread")
    confidences = group_stats(group.confidence_rewards, group.answer_group_ids)
    if not bool(confidences.all_agree(eps).all()):
        return FilterResult(True, "confidence_only")
    return FilterResult(False, "segments_agree")


_OUTCOME_METRICS = ("dropped_all_correct", "dropped_all_wrong")
FILTERS: dict[str, GroupFilter] = {
    "correct": GroupFilter(correct_spread, _OUTCOME_METRICS, ("correct",)),
    "seq_reward": GroupFilter(seq_reward_spread, _OUTCOME_METRICS, ("token_rewards",)),
    "segments": GroupFilter(segment_spread, ("kept_answer_spread", "kept_confidence_only", "dropped_segments_agree"),
                            ("answer_group_ids", "answer_rewards", "confidence_rewards")),
}
