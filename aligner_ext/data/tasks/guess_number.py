"""`guess_number`: find a secret integer from 1 to 100 in at most 7 guesses, told "higher" or "lower".

Played against the `guess_number` environment (agents/guess_number.py), which reads the game from
the row: `ground_truth` is the secret (as text, "37"), `extra_info` holds `low`, `high` and
`max_guesses`. Seven guesses are what bisection needs in the worst case over 100 numbers
(2**7 = 128 >= 100), so an agent that halves the range always wins.

Every row has the same user message; the rows differ in their secret. The split is by secret (the
SHA-256 bucket of "secret <n>", `base.in_split`: about 20 of the 100 secrets are val's), and rows
are drawn from the split's secrets in successive shuffles, as `arithmetic`'s are. The gold solution
is bisection's first guess, "50".
"""

from __future__ import annotations

from aligner_ext.data.tasks.base import TASKS, draw_from_pool, in_split, make_rows, record, split_rng
from aligner_ext.data.types import PromptRow

LOW, HIGH = 1, 100  # the secret's range, both ends included
MAX_GUESSES = 7  # bisection's worst case over LOW..HIGH
QUESTION = (f"Guess my number from {LOW} to {HIGH}. Each turn, answer with one number; I reply higher or lower. "
            f"You have {MAX_GUESSES} guesses.")


@TASKS.register("guess_number")
def guess_number(split: str, size: int, seed: int) -> list[PromptRow]:
    """`size` games of `split`, secrets drawn from the split's."""
    pool = [secret for secret in range(LOW, HIGH + 1) if in_split(f"secret {secret}", split)]
    chosen = draw_from_pool(pool, size, split_rng("guess_number", split, seed))
    records = [record("guess_number", QUESTION, str(secret), str((LOW + HIGH) // 2),
                      low=LOW, high=HIGH, max_guesses=MAX_GUESSES) for secret in chosen]
    return make_rows("guess_number", split, records)
