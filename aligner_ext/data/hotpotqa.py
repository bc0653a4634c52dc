"""HotpotQA-style rows -> dataset rows in MTPO's answer-then-confidence prompt format.

Accepted input rows (`.jsonl`, `.json` holding a list, or `.parquet`), one of:
- `question`, `answer` and `context` as in HotpotQA: `context` is either the original JSON's list
  of `[title, [sentence, ...]]` pairs, the HF `datasets` form `{"title": [...], "sentences":
  [[...], ...]}`, or a plain list of paragraph strings;
- `problem` and `answer`, where `problem` already holds the question and its paragraphs (RLCR's
  HotpotQA-Modified rows).
`answer` is a string or a list of acceptable strings. An `id` / `_id` column is kept in extra_info.

Output rows: system message `INSTRUCTION` (the two rounds: `<think>`/`<answer>`, then
`<analysis>`/`<confidence>`), user message `"PROBLEM: " + problem`, data_source `hotpotqa`
(graded by `squad_exact_match`, rewards/calibration.py), ground truth `answer`. The user turn
follows RLCR's ("\n\nPROBLEM: {problem}\n\n" there, stripped here); the paragraphs are written as
"Paragraph k (title):" then their sentences joined by spaces.

Convert once and train on the result:

    python -m aligner_ext.data.hotpotqa hotpot_train.json data/hotpot_mtpo_train.jsonl
    aligner-ext train +variant=mtpo data.train_files=[data/hotpot_mtpo_train.jsonl] ...

A malformed row raises `DataError` naming the file, the row and the field.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from aligner_ext.data.readers import DataError, parse_row, read_records
from aligner_ext.data.types import PromptRow

DATA_SOURCE = "hotpotqa"
INSTRUCTION = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant answers it "
    "from the given paragraphs. The Assistant first thinks about the reasoning process and then gives the "
    "answer, then analyses how likely that answer is to be correct and states a confidence between 0 and 1. "
    "The reasoning, answer, analysis and confidence are enclosed within <think> </think>, <answer> </answer>, "
    "<analysis> </analysis> and <confidence> </confidence> tags, i.e. <think> reasoning </think>"
    "<answer> answer </answer><analysis> analysis </analysis><confidence> confidence </confidence>. "
    "Put only the short answer within the answer tags; it is graded by exact match."
)


def format_context(context: Any, fail) -> str:
    """The paragraphs of a HotpotQA `context` (any accepted form) as prompt text."""
    if isinstance(context, dict):
        titles, sentences = context.get("title"), context.get("sentences")
        if not isinstance(titles, list) or not isinstance(sentences, list) or len(titles) != len(sentences):
            raise fail("context", "as an object needs equally long lists 'title' and 'sentences'")
        pairs = list(zip(titles, sentences))
    elif isinstance(context, list) and all(isinstance(p, str) for p in context):
        pairs = [(None, [p]) for p in context]
    elif isinstance(context, list) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in context):
        pairs = [tuple(p) for p in context]
    else:
        raise fail("context", "must be [[title, [sentences]], ...], {title: [...], sentences: [[...]]} "
                              "or a list of paragraph strings")
    if not pairs:
        raise fail("context", "holds no paragraph")
    paragraphs = []
    for index, (title, sentences) in enumerate(pairs):
        if not isinstance(sentences, list) or not all(isinstance(s, str) for s in sentences):
            raise fail(f"context[{index}]", "must hold a list of sentence strings")
        heading = f"Paragraph {index}" + (f" ({title})" if title else "")
        paragraphs.append(f"{heading}: {' '.join(s.strip() for s in sentences)}")
    return "\n".join(paragraphs)


def hotpotqa_record(raw: Any, path: str, index: int) -> dict[str, Any]:
    """One HotpotQA-style input row as a raw dataset record (the format `parse_row` reads)."""

    def fail(field: str, problem: str) -> DataError:
        return DataError(f"{path} row {index}: field {field!r} {problem}")

    if not isinstance(raw, dict):
        raise DataError(f"{path} row {index}: expected an object, got {type(raw).__name__}")
    answer = raw.get("answer")
    if not (isinstance(answer, str) and answer) and not (isinstance(answer, list) and answer
                                                         and all(isinstance(a, str) for a in answer)):
        raise fail("answer", "must be a non-empty string or list of strings")
    if isinstance(raw.get("problem"), str) and raw["problem"].strip():
        problem = raw["problem"].strip()
    elif isinstance(raw.get("question"), str) and raw["question"].strip():
        problem = f"{format_context(raw.get('context'), fail)}\n\nQuestion: {raw['question'].strip()}"
    else:
        raise fail("question", "(or 'problem') must be a non-empty string")
    row_id = raw.get("id", raw.get("_id"))
    return {
        "prompt": [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": f"PROBLEM: {problem}"}],
        "data_source": DATA_SOURCE,
        "reward_model": {"ground_truth": answer},
        "extra_info": {"id": row_id} if row_id is not None else {},
    }


def _records(path: str) -> list[dict[str, Any]]:
    return [hotpotqa_record(raw, path, index) for index, (_, raw) in enumerate(read_records(path))]


def load_hotpotqa(path: str) -> list[PromptRow]:
    """Every row of `path` as a PromptRow in the MTPO prompt format."""
    return [parse_row(record, path, index) for index, record in enumerate(_records(path))]


def convert(source: str, target: str) -> int:
    """Write the rows of `source` to `target` (.jsonl) in the dataset format; returns the row count."""
    records = _records(source)
    for index, record in enumerate(records):
        parse_row(record, source, index)  # the written file must load
    with open(target, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
    return len(records)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m aligner_ext.data.hotpotqa INPUT(.jsonl|.json|.parquet) OUTPUT.jsonl")
    print(f"wrote {convert(sys.argv[1], sys.argv[2])} rows to {sys.argv[2]}")
