"""`mixed_arithmetic`: sums and products of two integers at three difficulties, a third of the rows each, e.g.
"3+5=", "12+7=", "418*276=". Built so that most of GRPO's groups have rewards that all agree, which is what
dynamic sampling (DAPO) filters (docs/learning.md, section `mixed_arithmetic`):

    easy    a+b, both terms in [0, 9]        80 training problems, learnt by heart: all-correct groups
    medium  a+b, both terms in [0, 20]       `arithmetic`'s problems: groups of mixed outcomes, where GRPO learns
    hard    a*b, both terms in [100, 999]    beyond the tiny model: all-wrong groups

The gold solution is one line and the boxed result, "12+7=19\\n\\boxed{19}", "418*276=115368\\n\\boxed{115368}",
scored by `math_verify`. Each row draws its difficulty first, then its two terms, until the problem belongs to
the split (`base.in_split`), so the shares hold whatever the pools' sizes; the easy and medium pools overlap (a
one-digit sum is also a medium one), and `extra_info.difficulty` names the one drawn.
"""

from __future__ import annotations

import operator

from aligner_ext.data.tasks.base import TASKS, in_split, make_rows, record, split_rng
from aligner_ext.data.types import PromptRow

DIFFICULTIES = {"easy": ("+", range(0, 10)), "medium": ("+", range(0, 21)), "hard": ("*", range(100, 1000))}
OPERATIONS = {"+": operator.add, "*": operator.mul}


def question(a: int, symbol: str, b: int) -> str:
    return f"{a}{symbol}{b}="


@TASKS.register("mixed_arithmetic")
def mixed_arithmetic(split: str, size: int, seed: int) -> list[PromptRow]:
    """`size` problems of `split`, each row's difficulty drawn uniformly, then its two terms within it."""
    rng = split_rng("mixed_arithmetic", split, seed)
    records = []
    for _ in range(size):
        difficulty = rng.choice(sorted(DIFFICULTIES))
        symbol, terms = DIFFICULTIES[difficulty]
        a, b = rng.choice(terms), rng.choice(terms)
        while not in_split(question(a, symbol, b), split):
            a, b = rng.choice(terms), rng.choice(terms)
        answer = str(OPERATIONS[symbol](a, b))
        records.append(record("mixed_arithmetic", question(a, symbol, b), answer,
                              f"{question(a, symbol, b)}{answer}\n\\boxed{{{answer}}}", difficulty=difficulty))
    return make_rows("mixed_arithmetic", split, records)
