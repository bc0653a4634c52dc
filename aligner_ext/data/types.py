"""Row types that flow from the dataset to the experience maker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PromptRow:
    """One dataset row in the seeds' format (verl-style parquet / jsonl).

    `row_id` names where the row came from (``file:row`` or ``builtin/<task>/<split>:<index>``), so
    every later error or log line can point back at it.
    """

    row_id: str
    messages: list[dict[str, str]]  # chat messages: [{"role": "user", "content": ...}, ...]
    data_source: str  # selects the reward function
    ground_truth: Any = None  # reward_model.ground_truth
    rubrics: list[dict[str, Any]] | None = None  # reward_model.rubrics: [{criterion, points, tags}]
    extra_info: dict[str, Any] = field(default_factory=dict)  # gold_solution, context, ...


@dataclass(frozen=True)
class PromptDraw:
    """A row as drawn for one step: its tokenised prompt and a run-unique draw id.

    `draw_id` is the position of the draw in the run's prompt stream (epoch * dataset size + index),
    so it is unique, deterministic and survives resume; experience makers use it as the group id.
    """

    row: PromptRow
    prompt_ids: list[int]  # chat template applied with the generation prompt, not padded
    draw_id: int
