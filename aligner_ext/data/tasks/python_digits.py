"""`python_digits`: the sum of the decimal digits of a large power, e.g. "What is the sum of the digits of
7**83?" -> "318". Powers with 30 to 250 digits: no model sums those reliably in its head, and one line
of Python does, so the task needs the `python` tool (agents/python_environment.py, the environment
registered for this data_source). Without the environment, `math_verify` scores the rows.

The gold solution is the boxed answer alone; rows are split by the hash of their prompt (`base.in_split`).
"""

from __future__ import annotations

from aligner_ext.data.tasks.base import TASKS, draw_from_pool, in_split, make_rows, record, split_rng
from aligner_ext.data.types import PromptRow

BASES = range(2, 10)  # the power's base
EXPONENTS = range(100, 260)  # its exponent: 2**100 has 31 digits, 9**259 has 248


def question(base: int, exponent: int) -> str:
    return (f"What is the sum of the digits of {base}**{exponent}? Run Python to find out; "
            "answer in \\boxed{}.")


@TASKS.register("python_digits")
def python_digits(split: str, size: int, seed: int) -> list[PromptRow]:
    """`size` digit sums of `split`'s powers (1,280 problems in all, `base.draw_from_pool`)."""
    problems = [(b, e) for b in BASES for e in EXPONENTS if in_split(question(b, e), split)]
    records = []
    for base, exponent in draw_from_pool(problems, size, split_rng("python_digits", split, seed)):
        answer = str(sum(map(int, str(base ** exponent))))
        records.append(record("python_digits", question(base, exponent), answer, f"\\boxed{{{answer}}}"))
    return make_rows("python_digits", split, records)
