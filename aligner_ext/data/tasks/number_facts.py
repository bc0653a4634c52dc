"""`number_facts`: "List facts about N." graded by a rubric of five independent facts, one point each.

For N in [MIN_NUMBER, MAX_NUMBER] (points in brackets):
    parity        "states that N is even|odd"               (+1)  check "N is even|odd"
    digits        "gives the number of digits (d)"          (+1)  check "d digits"
    last digit    "gives the last digit (x)"                (+1)  check "last digit is x"
    first digit   "gives the first digit (y)"               (+1)  check "first digit is y"
    size          "says that N is less than|at least 500"   (+1)  check "N is less than 500|N is at least 500"
Each item's `example` is a sentence meeting it ("418 is even.", "It has 3 digits.", "Its last digit is 8.",
...), graded by the rule grader's `contains` check (`rubric_qa.check_passes`): reward `rubric`, the share
of the five facts a response states.

Built so that the graded system prompt has something to scaffold (docs/learning.md, section
`number_facts`): the gold solution is the short answer, the parity sentence alone ("418 is even."), so a
model warmed up on it states one fact in five, and the other four are facts it states only when it is
shown them (the graded prompt's warm-up, `graded_prompt.warmup_unshown_share`). Each fact is read off N's
digits, so a model shown the criterion can write it. Rows are split by the hash of their prompt
(`base.in_split`).
"""

from __future__ import annotations

from typing import Any

from aligner_ext.data.tasks.base import TASKS, draw_from_pool, in_split, make_rows, record, split_rng
from aligner_ext.data.tasks.rubric_qa import rubric_item
from aligner_ext.data.types import PromptRow

MIN_NUMBER, MAX_NUMBER = 10, 999  # the numbers asked about
SIZE_THRESHOLD = 500  # the size fact compares N with it


def rubric(n: int) -> list[dict[str, Any]]:
    """The five facts about n, in the order the gold solution would state them."""
    digits = str(n)
    parity = "even" if n % 2 == 0 else "odd"
    size = f"less than {SIZE_THRESHOLD}" if n < SIZE_THRESHOLD else f"at least {SIZE_THRESHOLD}"
    return [
        rubric_item(f"states that {n} is {parity}", 1, "parity", f"{n} is {parity}", f"{n} is {parity}."),
        rubric_item(f"gives the number of digits ({len(digits)})", 1, "digits", f"{len(digits)} digits",
                    f"It has {len(digits)} digits."),
        rubric_item(f"gives the last digit ({digits[-1]})", 1, "last_digit", f"last digit is {digits[-1]}",
                    f"Its last digit is {digits[-1]}."),
        rubric_item(f"gives the first digit ({digits[0]})", 1, "first_digit", f"first digit is {digits[0]}",
                    f"Its first digit is {digits[0]}."),
        rubric_item(f"says that {n} is {size}", 1, "size", f"{n} is {size}", f"{n} is {size}."),
    ]


def question(n: int) -> str:
    return f"List facts about {n}."


@TASKS.register("number_facts")
def number_facts(split: str, size: int, seed: int) -> list[PromptRow]:
    """`size` rubric-graded rows drawn from the numbers of `split`."""
    pool = [n for n in range(MIN_NUMBER, MAX_NUMBER + 1) if in_split(question(n), split)]
    records = []
    for n in draw_from_pool(pool, size, split_rng("number_facts", split, seed)):
        items = rubric(n)
        records.append(record("number_facts", question(n), None, items[0]["example"], rubrics=items, number=n))
    return make_rows("number_facts", split, records)
