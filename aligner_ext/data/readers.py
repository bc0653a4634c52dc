"""Read dataset rows (verl-style parquet, jsonl, or json holding a list) into `PromptRow`s, checking every field.

Row format, as in the seeds:

    prompt        list of chat messages [{"role": "system"|"user"|"assistant", "content": str}, ...]
    data_source   str, selects the reward function
    reward_model  {"ground_truth": any, "rubrics": [{"criterion": str, "points": number,
                   "tags": [str] (optional), ...}] (optional)}
    extra_info    dict (optional): gold_solution, context, ...

Decisions:
- `reward_model.ground_truth` may be absent (or null) only when the row has a non-empty `rubrics`
  list: rubric-graded rows need no single answer; every other row does.
- Keys whose value is null are dropped from messages, rubric items and `extra_info`. A parquet
  struct column gives every row every key of the union schema (null where the row had none), so
  without this a parquet row and its jsonl twin would read differently.
- Other top-level columns (verl's `ability`, `index`, ...) are ignored.
- Blank jsonl lines are skipped; rows are numbered from 0 over the non-blank lines, and a jsonl
  error also names the 1-based line number.
- `row_id` is ``f"{path}:{index}"`` so later errors and logs point back at the row.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from typing import Any, Callable

from aligner_ext.data.types import PromptRow
from aligner_ext.errors import DataError, UserError

ROLES = ("system", "user", "assistant")


class MissingDataFile(UserError, FileNotFoundError):
    """A dataset file named in the config does not exist."""


Fail = Callable[[str, str], DataError]  # (field, problem) -> the error to raise for this row


def load_files(paths: list[str]) -> list[PromptRow]:
    """Rows of every file in `paths`, in order."""
    return [row for path in paths for row in load_rows(path)]


def load_rows(path: str) -> list[PromptRow]:
    """Rows of one `.parquet`, `.jsonl` or `.json` file; raises `DataError` on the first malformed row."""
    return [parse_row(record, path, index, where) for index, (where, record) in enumerate(read_records(path))]


def read_records(path: str) -> list[tuple[str, Any]]:
    """The raw records of a `.parquet`, `.jsonl` or `.json` (a list) file, each with where it stood
    (`" (line N)"` for jsonl, else ""); an empty file, bad JSON or another file type is a `DataError`."""
    if not os.path.isfile(path):
        raise MissingDataFile(f"dataset file not found: {path}")
    if path.endswith(".parquet"):
        records = _read_parquet(path)
    elif path.endswith(".jsonl"):
        records = _read_jsonl(path)
    elif path.endswith(".json"):
        records = _read_json(path)
    else:
        raise DataError(f"{path}: unsupported file type; expected .parquet, .jsonl or .json")
    if not records:
        raise DataError(f"{path}: the file holds no rows")
    return records


def _read_parquet(path: str) -> list[tuple[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: cannot read as parquet: {err}") from err
    return [("", record) for record in table.to_pylist()]


def _read_jsonl(path: str) -> list[tuple[str, Any]]:
    records = []
    with open(path, "rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            line = _utf8(raw, path, line_number)
            if not line.strip():
                continue
            where = f" (line {line_number})"
            try:
                records.append((where, json.loads(line)))
            except json.JSONDecodeError as err:
                raise DataError(f"{path} row {len(records)}{where}: invalid JSON: {err}") from err
    return records


def _read_json(path: str) -> list[tuple[str, Any]]:
    with open(path, "rb") as handle:
        data = handle.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _not_utf8(path, data[: err.start].count(b"\n") + 1, err) from err
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: invalid JSON: {err}") from err
    if not isinstance(rows, list):
        raise DataError(f"{path}: a .json file must hold a list of rows")
    return [("", row) for row in rows]


def _utf8(raw: bytes, path: str, line_number: int) -> str:
    """Line `line_number` of `path`, decoded, or a DataError naming the line."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _not_utf8(path, line_number, err) from err


def _not_utf8(path: str, line_number: int, err: UnicodeDecodeError) -> DataError:
    return DataError(f"{path} line {line_number}: not UTF-8 text ({err.reason}); save the file as UTF-8")


def parse_row(record: Any, path: str, index: int, where: str = "") -> PromptRow:
    """Check one raw record and turn it into a `PromptRow`; `where` adds e.g. a line number."""

    def fail(field: str, problem: str) -> DataError:
        return DataError(f"{path} row {index}{where}: field {field!r} {problem}")

    if not isinstance(record, dict):
        raise DataError(f"{path} row {index}{where}: expected an object, got {type(record).__name__}")
    messages = _parse_messages(record.get("prompt"), fail)
    data_source = record.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        raise fail("data_source", "must be a non-empty string")
    reward_model = record.get("reward_model")
    if not isinstance(reward_model, dict):
        raise fail("reward_model", "must be an object with 'ground_truth' and/or 'rubrics'")
    rubrics = _parse_rubrics(reward_model.get("rubrics"), fail)
    ground_truth = reward_model.get("ground_truth")
    if isinstance(ground_truth, float) and not math.isfinite(ground_truth):  # NaN would match nothing, silently
        raise fail("reward_model.ground_truth", f"is {ground_truth}: a ground truth must be a finite value")
    if ground_truth is None and not rubrics:
        raise fail("reward_model.ground_truth", "is required when the row has no rubrics")
    extra_info = record.get("extra_info")
    if extra_info is None:
        extra_info = {}
    if not isinstance(extra_info, dict):
        raise fail("extra_info", "must be an object when present")
    return PromptRow(
        row_id=f"{path}:{index}",
        messages=messages,
        data_source=data_source,
        ground_truth=ground_truth,
        rubrics=rubrics,
        extra_info=_drop_nulls(extra_info),
    )


def _parse_messages(prompt: Any, fail: Fail) -> list[dict[str, str]]:
    shape = "must be a non-empty list of {role, content} messages"
    if not isinstance(prompt, list) or not prompt:
        raise fail("prompt", shape)
    messages = []
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise fail(f"prompt[{i}]", shape)
        if message.get("role") not in ROLES:
            raise fail(f"prompt[{i}].role", f"must be one of {', '.join(ROLES)}; got {message.get('role')!r}")
        if not isinstance(message.get("content"), str):
            raise fail(f"prompt[{i}].content", "must be a string")
        messages.append(_drop_nulls(message))
    return messages


def _parse_rubrics(rubrics: Any, fail: Fail) -> list[dict[str, Any]] | None:
    """None when absent; otherwise every item checked (criterion, points, optional tags)."""
    if rubrics is None:
        return None
    if not isinstance(rubrics, list):
        raise fail("reward_model.rubrics", "must be a list of {criterion, points, tags} items")
    items = []
    for i, item in enumerate(rubrics):
        field = f"reward_model.rubrics[{i}]"
        if not isinstance(item, dict):
            raise fail(field, "must be an object {criterion, points, tags}")
        item = _drop_nulls(item)
        if not isinstance(item.get("criterion"), str) or not item["criterion"]:
            raise fail(f"{field}.criterion", "must be a non-empty string")
        points = item.get("points")
        if not isinstance(points, numbers.Real) or isinstance(points, bool):
            raise fail(f"{field}.points", f"must be a number; got {points!r}")
        tags = item.get("tags", [])
        if not isinstance(tags, list) or not all(isinstance(tag, str) for tag in tags):
            raise fail(f"{field}.tags", "must be a list of strings when present")
        items.append(item)
    return items


def _drop_nulls(mapping: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in mapping.items() if value is not None}
