"""`chain_sums`: sums of three integers up to 99, e.g. "85+21+8=", solved in two steps. Built so that a
gold-solution hint carries what the model lacks, which is what CPO's advantage reads (docs/learning.md,
section `chain_sums`).

The gold solution adds one term per line, `arithmetic`'s format: "85+21=106\\n106+8=114\\n\\boxed{114}".
Each step is a two-term sum with carries, which the tiny model gets right only some of the time, and a
response is right only when both steps are, so many groups are all wrong: there GRPO's advantage is zero
and CPO's `negonly_mi3` shapes the wrong responses' tokens by the hint. Under a hint holding those lines, a
response that repeats them is more likely than without it: the gain CPO measures
(`cpo/hint_gain_correct`), once the model has learned to read a hint (`cpo.hint.warmup_share`).
Scored by `math_verify`.

The problem space (100^3 sums) is large, so rows are drawn at random and kept only if their prompt text
belongs to the split (`base.in_split`).
"""

from __future__ import annotations

from aligner_ext.data.tasks.arithmetic import gold_solution, question
from aligner_ext.data.tasks.base import TASKS, in_split, make_rows, record, split_rng
from aligner_ext.data.types import PromptRow

NUM_TERMS = 3  # terms per sum: NUM_TERMS - 1 steps
MAX_TERM = 99  # each term is an integer in [0, MAX_TERM]


@TASKS.register("chain_sums")
def chain_sums(split: str, size: int, seed: int) -> list[PromptRow]:
    """`size` sums of `split`, terms drawn uniformly."""
    rng = split_rng("chain_sums", split, seed)
    records = []
    while len(records) < size:
        terms = tuple(rng.randint(0, MAX_TERM) for _ in range(NUM_TERMS))
        if in_split(question(terms), split):
            records.append(record("chain_sums", question(terms), str(sum(terms)), gold_solution(terms)))
    return make_rows("chain_sums", split, records)
