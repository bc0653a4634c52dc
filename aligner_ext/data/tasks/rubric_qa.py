"""`rubric_qa`: "Describe the number N." graded by a rubric of weighted criteria.

For N in [MIN_NUMBER, MAX_NUMBER] the rubric holds (points in brackets):
    parity            "states that N is even|odd"                 (+3)  check "N is even|odd"
    digits            "gives the number of digits (d)"            (+2)  check "d digits" ("1 digit")
    prime / factors   composite: "gives the prime factorisation"  (+2)  check "2*2*3" (for 12)
                      prime:     "states that N is prime"         (+2)  check "N is prime"
    wrong claim       composite: "claims that N is prime"         (-4)  check "N is prime"
                      prime:     "claims that N is not prime"     (-4)  check "N is not prime"
ground_truth is absent (the rubric grades the row); the gold solution meets every positive
criterion and no negative one, e.g. "12 is even. It has 2 digits. 12 = 2*2*3, so 12 is not prime."
Each item also carries an `example`: one sentence that meets it ("12 is even."); the gold solution is
the positive items' examples joined by spaces, and the graded system prompt's warm-up of the embedded
model builds responses meeting a chosen subset of criteria from them
(experience/graded_prompt.py::warmup_target).

Each rubric item carries a machine-checkable `check` spec for a deterministic rule-based grader,
beside the criterion text a judge model would read. The one check type is
    {"type": "contains", "value": str}: met when `value` occurs in the response, ignoring case,
    with no letter or digit directly before or after it (so "2 is even" is not met by "12 is even").
`check_passes` is the reference implementation of that rule.
"""

from __future__ import annotations

import re
from typing import Any

from aligner_ext.data.tasks.base import TASKS, draw_from_pool, in_split, make_rows, record, split_rng
from aligner_ext.data.types import PromptRow

MIN_NUMBER = 2  # smallest number asked about (1 is neither prime nor composite)
MAX_NUMBER = 99  # largest number asked about


def check_passes(check: dict[str, Any], response: str) -> bool:
    """Whether `response` meets a rubric item's `check` spec (see the module docstring)."""
    if check.get("type") != "contains":
        raise ValueError(f"unknown rubric check type {check.get('type')!r}; known: 'contains'")
    pattern = r"(?<![A-Za-z0-9])" + re.escape(check["value"]) + r"(?![A-Za-z0-9])"
    return re.search(pattern, response, flags=re.IGNORECASE) is not None


def prime_factors(n: int) -> list[int]:
    """Prime factors of n >= 2 in increasing order, with repetition."""
    factors, p = [], 2
    while p * p <= n:
        while n % p == 0:
            factors.append(p)
            n //= p
        p += 1
    return factors + ([n] if n > 1 else [])


def rubric_item(criterion: str, points: int, tag: str, value: str, example: str) -> dict[str, Any]:
    return {"criterion": criterion, "points": points, "tags": [tag], "check": {"type": "contains", "value": value},
            "example": example}


def rubric_and_gold(n: int) -> tuple[list[dict[str, Any]], str]:
    """The rubric of "Describe the number n." and a response that earns every positive point."""
    parity = "even" if n % 2 == 0 else "odd"
    digits = len(str(n))
    digit_words = f"{digits} digit" + ("s" if digits > 1 else "")
    factors = "*".join(str(p) for p in prime_factors(n))
    rubric = [
        rubric_item(f"states that {n} is {parity}", 3, "parity", f"{n} is {parity}", f"{n} is {parity}."),
        rubric_item(f"gives the number of digits ({digits})", 2, "digits", digit_words, f"It has {digit_words}."),
    ]
    if len(prime_factors(n)) == 1:
        rubric.append(rubric_item(f"states that {n} is prime", 2, "primality", f"{n} is prime", f"{n} is prime."))
        rubric.append(rubric_item(f"claims that {n} is not prime", -4, "wrong_claim", f"{n} is not prime",
                            f"{n} is not prime."))
    else:
        rubric.append(rubric_item(f"gives the prime factorisation {factors}", 2, "factorisation", factors,
                            f"{n} = {factors}, so {n} is not prime."))
        rubric.append(rubric_item(f"claims that {n} is prime", -4, "wrong_claim", f"{n} is prime", f"{n} is prime."))
    gold = " ".join(item["example"] for item in rubric if item["points"] > 0)
    return rubric, gold


def question(n: int) -> str:
    return f"Describe the number {n}."


@TASKS.register("rubric_qa")
def rubric_qa(split: str, size: int, seed: int) -> list[PromptRow]:
    """`size` rubric-graded rows drawn from the numbers of `split`."""
    pool = [n for n in range(MIN_NUMBER, MAX_NUMBER + 1) if in_split(question(n), split)]
    records = []
    for n in draw_from_pool(pool, size, split_rng("rubric_qa", split, seed)):
        rubric, gold = rubric_and_gold(n)
        records.append(record("rubric_qa", question(n), None, gold, rubrics=rubric, number=n))
    return make_rows("rubric_qa", split, records)
