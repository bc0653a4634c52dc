"""`chain_sums` and `three_digit_sums`: sums whose gold solution adds one term per line, the tasks built
for CPO's precondition (docs/learning.md, sections `chain_sums` and `three_digit_sums`).

- `chain_sums`: three integers up to 99, e.g. "85+21+8=", solved in two steps. Each step is a two-term
  sum with carries, which the tiny model gets right only some of the time, and a response is right only
  when both steps are, so many groups are all wrong: there GRPO's advantage is zero and CPO's
  `negonly_mi3` shapes the wrong responses' tokens by the hint. Under a hint holding those lines, a
  response that repeats them should be more likely than without it: the gain CPO measures
  (`cpo/hint_gain_correct`), once the model has learned to read a hint (`cpo.hint.warmup_share`).
  Measured: the warmed model gets about half right and is sure of those, so the hint adds nothing to them.
- `three_digit_sums`: two integers up to 999, e.g. "418+276=", one step. Built for the other side of
  the precondition: a warmed model that can barely add three-digit numbers but has learned to copy a hint
  ("418+276=694\\n\\boxed{694}"), so that the hint raises the few correct responses a great deal.

The gold solution is `arithmetic`'s format; scored by `math_verify`. The problem spaces are large, so rows
are drawn at random and kept only if their prompt text belongs to the split (`base.in_split`).
"""

from __future__ import annotations

from aligner_ext.data.tasks.arithmetic import gold_solution, question
from aligner_ext.data.tasks.base import TASKS, in_split, make_rows, record, split_rng
from aligner_ext.data.types import PromptRow


def sums(task: str, split: str, size: int, seed: int, num_terms: int, max_term: int) -> list[PromptRow]:
    """`size` sums of `num_terms` integers in [0, `max_term`] drawn uniformly, of `split`."""
    rng = split_rng(task, split, seed)
    records = []
    while len(records) < size:
        terms = tuple(rng.randint(0, max_term) for _ in range(num_terms))
        if in_split(question(terms), split):
            records.append(record(task, question(terms), str(sum(terms)), gold_solution(terms)))
    return make_rows(task, split, records)


@TASKS.register("chain_sums")
def chain_sums(split: str, size: int, seed: int) -> list[PromptRow]:
    return sums("chain_sums", split, size, seed, num_terms=3, max_term=99)


@TASKS.register("three_digit_sums")
def three_digit_sums(split: str, size: int, seed: int) -> list[PromptRow]:
    return sums("three_digit_sums", split, size, seed, num_terms=2, max_term=999)
