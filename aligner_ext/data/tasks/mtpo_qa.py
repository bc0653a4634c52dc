"""`mtpo_short_qa`: the `short_qa` task in MTPO's answer-then-confidence format (the MTPO demo).

Not registered by name (the built-in task list stays the generic tasks'): select it with the dotted
path `data.builtin_task=aligner_ext.data.tasks.mtpo_qa:mtpo_short_qa`, as conf/variant/mtpo.yaml does.

The rows are `short_qa`'s (same problems, train/val split, ground truth and reward function:
data_source `short_qa`, SQuAD exact match) with a line asking for the two rounds' tags appended to
the user message (kept short: the character tokenizer makes every character a token), and a gold
solution that spans both, e.g.

    <think>Tom has a red ball.</think><answer>red</answer><analysis>ok</analysis><confidence>0.9</confidence>

The think part quotes the context sentence about the asked person and object, or says "none"
when there is none (the answer is then "unknown").

Decision: the confidence of a gold solution is drawn independently of the row, 0.9 with
probability MODE_PROBABILITY and otherwise uniformly from 0.1 .. 0.8. A supervised warm-up on these
targets learns the format and a confidence that says nothing about correctness: greedy decoding
states 0.9 everywhere (over-confident unless accuracy is 0.9), and sampling still explores other
values, which is what the confidence round's RL needs to improve calibration.
"""

from __future__ import annotations

import re

from aligner_ext.data.readers import parse_row
from aligner_ext.data.tasks.base import split_rng
from aligner_ext.data.tasks.short_qa import short_qa
from aligner_ext.data.types import PromptRow

INSTRUCTION = "Tags: think, answer, then analysis, confidence (0-1)."  # the last line of every user message
MODE_CONFIDENCE = "0.9"  # the gold solutions' most frequent confidence
MODE_PROBABILITY = 0.2  # its share; the rest is spread evenly over 0.1 .. 0.8 (0.1 each)
OTHER_CONFIDENCES = tuple(f"0.{d}" for d in range(1, 9))
ANALYSIS = "ok"  # the gold analysis: the same for every row, so it carries no information

_QUESTION = re.compile(r"What color is (\w+)'s (\w+)\?")


def thought(context: str, question: str) -> str:
    """The context sentence about the asked person's asked object, or "none"."""
    match = _QUESTION.search(question)
    if match is None:
        raise ValueError(f"not a short_qa question: {question!r}")
    name, obj = match.groups()
    for sentence in re.findall(r"[^.]+\.", context):
        sentence = sentence.strip()
        if sentence.startswith(f"{name} has a ") and sentence.endswith(f" {obj}."):
            return sentence
    return "none"


def mtpo_short_qa(split: str, size: int, seed: int) -> list[PromptRow]:
    """`size` short_qa rows of `split` with the MTPO instruction and a two-round gold solution."""
    rng = split_rng("mtpo_short_qa", split, seed)
    records = []
    for row in short_qa(split, size, seed):
        context, question = row.messages[-1]["content"].split("\n", 1)
        confidence = MODE_CONFIDENCE if rng.random() < MODE_PROBABILITY else rng.choice(OTHER_CONFIDENCES)
        gold = (f"<think>{thought(context, question)}</think><answer>{row.ground_truth}</answer>"
                f"<analysis>{ANALYSIS}</analysis><confidence>{confidence}</confidence>")
        records.append({
            "prompt": [{"role": "user", "content": f"{context}\n{question}\n{INSTRUCTION}"}],
            "data_source": row.data_source,
            "reward_model": {"ground_truth": row.ground_truth},
            "extra_info": {**row.extra_info, "gold_solution": gold},
        })
    return [parse_row(record, f"builtin/mtpo_short_qa/{split}", index) for index, record in enumerate(records)]
