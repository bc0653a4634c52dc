"""`short_qa`: one-word answers read from a short context; some questions cannot be answered.

Example: context "Tom has a red ball. Ann has a blue kite.", question "What color is Tom's ball?"
-> "red"; "What color is Ben's hat?" -> "unknown" (Ben is not in the context, or Tom has no hat).
The user message is the context, a newline, then the question. About UNANSWERABLE_FRACTION of the
rows are unanswerable, with ground truth "unknown". extra_info holds `context`, `answerable` and
the gold solution "\\boxed{<answer>}".

The problem space (8 names, 6 colours, 6 objects, two people per context) is large, so rows are
drawn at random and kept only if their prompt text belongs to the split (`base.in_split`).
"""

from __future__ import annotations

import random

from aligner_ext.data.tasks.base import TASKS, in_split, make_rows, record, split_rng
from aligner_ext.data.types import PromptRow

NAMES = ("Tom", "Ann", "Ben", "Sue", "Max", "Eva", "Sam", "Lily")
COLORS = ("red", "blue", "green", "black", "white", "pink")
OBJECTS = ("ball", "kite", "hat", "cup", "bag", "box")
PEOPLE_PER_CONTEXT = 2  # "X has a C O." sentences per context
UNANSWERABLE_FRACTION = 0.3  # probability that a row's question has no answer in its context
UNKNOWN = "unknown"  # ground truth of an unanswerable question


def sample_problem(rng: random.Random) -> tuple[str, str, str]:
    """(context, question, answer) for one random problem."""
    people = rng.sample(NAMES, PEOPLE_PER_CONTEXT)
    held = {name: (rng.choice(COLORS), rng.choice(OBJECTS)) for name in people}
    context = " ".join(f"{name} has a {color} {obj}." for name, (color, obj) in held.items())
    if rng.random() < UNANSWERABLE_FRACTION:
        name = rng.choice(NAMES)  # someone absent from the context, or present but without this object
        obj = rng.choice([o for o in OBJECTS if name not in held or held[name][1] != o])
        answer = UNKNOWN
    else:
        name = rng.choice(people)
        answer, obj = held[name]
    return context, f"What color is {name}'s {obj}?", answer


@TASKS.register("short_qa")
def short_qa(split: str, size: int, seed: int) -> list[PromptRow]:
    """`size` rows of `split`, unanswerable ones included."""
    rng = split_rng("short_qa", split, seed)
    records = []
    while len(records) < size:
        context, question, answer = sample_problem(rng)
        user = f"{context}\n{question}"
        if in_split(user, split):
            records.append(record("short_qa", user, answer, f"\\boxed{{{answer}}}",
                                  context=context, answerable=answer != UNKNOWN))
    return make_rows("short_qa", split, records)
