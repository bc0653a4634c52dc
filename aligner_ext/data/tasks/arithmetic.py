"""`arithmetic`: sums of small non-negative integers, e.g. "12+7=" -> "19".

Prompts are kept short on purpose: the built-in character tokenizer makes every character a
token and the built-in model is trained from scratch. The gold solution adds one operand per line
and ends in a boxed answer, e.g. "12+7=19\\n\\boxed{19}" or, with three operands,
"3+4=7\\n7+5=12\\n\\boxed{12}".

With the defaults the whole pool is 21 * 21 = 441 problems, so the split is by problem (see
`base.in_split`: about 20% of the pairs are val) and rows are drawn from the split's pool.
"""

from __future__ import annotations

import itertools

from aligner_ext.data.tasks.base import TASKS, draw_from_pool, in_split, make_rows, record, split_rng
from aligner_ext.data.types import PromptRow

NUM_OPERANDS = 2  # terms per sum
MAX_OPERAND = 20  # each term is an integer in [0, MAX_OPERAND]


def question(operands: tuple[int, ...]) -> str:
    """The user message, e.g. "12+7="."""
    return "+".join(str(x) for x in operands) + "="


def gold_solution(operands: tuple[int, ...]) -> str:
    """One line per partial sum, then the boxed total."""
    lines = []
    total = operands[0]
    for x in operands[1:]:
        lines.append(f"{total}+{x}={total + x}")
        total += x
    return "\n".join(lines + [f"\\boxed{{{total}}}"])


@TASKS.register("arithmetic")
def arithmetic(split: str, size: int, seed: int) -> list[PromptRow]:
    """`size` sums drawn from the problems of `split`."""
    all_problems = itertools.product(range(MAX_OPERAND + 1), repeat=NUM_OPERANDS)
    pool = [ops for ops in all_problems if in_split(question(ops), split)]
    chosen = draw_from_pool(pool, size, split_rng("arithmetic", split, seed))
    records = [record("arithmetic", question(ops), str(sum(ops)), gold_solution(ops)) for ops in chosen]
    return make_rows("arithmetic", split, records)
