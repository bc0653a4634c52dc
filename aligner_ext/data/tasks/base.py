"""The built-in task registry and what every built-in task shares.

A task is a function `task(split, size, seed) -> list[PromptRow]`, registered in `TASKS`. Its
rows are built as raw records in the dataset file format and go through the same `parse_row` as
rows read from parquet / jsonl, so built-in and user data take one code path.

Decisions:
- Deterministic: each (task, split, seed) seeds its own `random.Random` from a string, which
  Python hashes stably (unlike `hash()`), so rows do not depend on the process or the order of calls.
- Train and val never share a problem: a problem belongs to val when the SHA-256 of its prompt
  text falls in the first `VAL_PERCENT` of 100 buckets, whatever the seed.
- Small pools are drawn by concatenating fresh shuffles, so every problem of a split appears
  either floor(size / pool) or ceil(size / pool) times: no problem is over-weighted in evaluation.
- `extra_info.gold_solution` holds the answer text a supervised warm-up trains on (`sft_target`).
- A task whose gold responses presuppose a skill the embedded model does not pick up from them
  registers drills for it in `DRILLS` under the task's name: `drills(count, seed) -> [(messages,
  target)]`, trained for `model.warmup.drill_steps` steps before the gold responses (models/warmup.py).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Sequence, TypeVar

from aligner_ext.data.readers import parse_row
from aligner_ext.data.types import PromptRow
from aligner_ext.errors import DataError
from aligner_ext.registry import Registry

SPLITS = ("train", "val")
VAL_PERCENT = 20  # share of each task's problems reserved for the val split, in percent

TASKS = Registry("builtin task")
DRILLS = Registry("warm-up drill")  # task name -> drills(count, seed) (module docstring)

T = TypeVar("T")


def builtin_rows(task: str, split: str, size: int, seed: int) -> list[PromptRow]:
    """`size` rows of built-in `task` for `split` ("train" or "val"); unknown names list the known ones."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} for builtin task {task!r}; expected one of {SPLITS}")
    if size < 1:
        raise ValueError(f"builtin task {task!r} {split} size must be >= 1, got {size}")
    return TASKS.get(task)(split, size, seed)


def sft_target(row: PromptRow) -> str:
    """The response a supervised warm-up trains on for `row` (no end-of-turn token)."""
    gold = row.extra_info.get("gold_solution")
    if not isinstance(gold, str) or not gold:
        raise DataError(f"row {row.row_id} has no extra_info.gold_solution to use as the supervised target")
    return gold


def split_rng(task: str, split: str, seed: int) -> random.Random:
    """The random stream of one (task, split, seed)."""
    return random.Random(f"aligner_ext/{task}/{split}/{seed}")


def in_split(problem: str, split: str) -> bool:
    """Whether the problem whose prompt text is `problem` belongs to `split`."""
    bucket = int.from_bytes(hashlib.sha256(problem.encode("utf-8")).digest()[:8], "big") % 100
    return (bucket < VAL_PERCENT) == (split == "val")


def draw_from_pool(pool: Sequence[T], size: int, rng: random.Random) -> list[T]:
    """`size` items from `pool`: one shuffle after another, cut at `size`."""
    if not pool:
        raise ValueError("cannot draw rows from an empty problem pool")
    drawn: list[T] = []
    while len(drawn) < size:
        drawn.extend(rng.sample(list(pool), len(pool)))
    return drawn[:size]


def make_rows(task: str, split: str, records: list[dict[str, Any]]) -> list[PromptRow]:
    """PromptRows from raw records, row ids ``builtin/<task>/<split>:<index>``."""
    return [parse_row(record, f"builtin/{task}/{split}", index) for index, record in enumerate(records)]


def record(data_source: str, user: str, ground_truth: Any, gold_solution: str,
           rubrics: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    """A raw row in the dataset file format: one user message, reward spec, extra_info."""
    return {
        "prompt": [{"role": "user", "content": user}],
        "data_source": data_source,
        "reward_model": {"ground_truth": ground_truth, "rubrics": rubrics},
        "extra_info": {"gold_solution": gold_solution, **extra},
    }
