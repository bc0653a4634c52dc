"""`mixed_sums`: sums of two integers at three difficulties, a third of the rows each, e.g. "3+5=", "12+7=",
"418+276=". Built so that most of GRPO's groups have rewards that all agree, which is what dynamic
sampling (DAPO) filters (docs/learning.md, section `mixed_sums`):

    easy    both terms in [0, 9]       the warmed model answers them nearly always: all-correct groups
    medium  both terms in [0, 20]      `arithmetic`'s problems: groups of mixed outcomes, where GRPO learns
    hard    both terms in [100, 999]   beyond the tiny model: all-wrong groups

The gold solution is `arithmetic`'s ("418+276=694\\n\\boxed{694}"), scored by `math_verify`. Each row
draws its difficulty first, then its two terms, until the problem belongs to the split (`base.in_split`), so
the shares hold whatever the pools' sizes; the easy and medium pools overlap (a one-digit sum is also a
medium one), and `extra_info.difficulty` names the one drawn.
"""

from __future__ import annotations

from aligner_ext.data.tasks.arithmetic import gold_solution, question
from aligner_ext.data.tasks.base import TASKS, in_split, make_rows, record, split_rng
from aligner_ext.data.types import PromptRow

DIFFICULTIES = {"easy": range(0, 10), "medium": range(0, 21), "hard": range(100, 1000)}  # each term's range


@TASKS.register("mixed_sums")
def mixed_sums(split: str, size: int, seed: int) -> list[PromptRow]:
    """`size` sums of `split`, each row's difficulty drawn uniformly, then its problem within it."""
    rng = split_rng("mixed_sums", split, seed)
    records = []
    for _ in range(size):
        difficulty = rng.choice(sorted(DIFFICULTIES))
        terms = DIFFICULTIES[difficulty]
        pair = (rng.choice(terms), rng.choice(terms))
        while not in_split(question(pair), split):
            pair = (rng.choice(terms), rng.choice(terms))
        records.append(record("mixed_sums", question(pair), str(sum(pair)), gold_solution(pair), difficulty=difficulty))
    return make_rows("mixed_sums", split, records)
