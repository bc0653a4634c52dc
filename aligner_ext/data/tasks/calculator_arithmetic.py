"""`calculator_arithmetic`: a sum or a product of two 6- to 9-digit integers, to answer with a calculator.

Example: "Compute 48213977*5021934 with the calculator; answer in \\boxed{}." -> ground truth
"242127410371518". Numbers this long are beyond what the built-in tiny model adds or multiplies
reliably digit by digit, so its accuracy shows whether it learned to call the `calculator` tool
(agents/calculator.py, the environment registered for this data_source). Without the environment
the rows are scored by `math_verify` as `arithmetic` is, the same task without the tool.

The gold solution is the boxed answer alone, "\\boxed{242127410371518}": the tool call that leads
to it is written in the model family's own syntax, which a task does not know. The whole correct
episode is in `extra_info.gold_transcript` as OpenAI messages (the call, the tool's result, the boxed
answer), which the chat template renders in the family's syntax: the supervised warm-up of agent
episodes teaches it (experience/agent_episodes.py).

The problem space is large, so rows are drawn at random and kept only if their prompt text belongs
to the split (`base.in_split`).
"""

from __future__ import annotations

import operator
import random
from typing import Any

from aligner_ext.data.tasks.base import TASKS, in_split, make_rows, record, split_rng
from aligner_ext.data.types import PromptRow

MIN_DIGITS, MAX_DIGITS = 6, 9  # each operand's number of digits, drawn uniformly
OPERATIONS = {"+": operator.add, "*": operator.mul}


def operand(rng: random.Random) -> int:
    digits = rng.randint(MIN_DIGITS, MAX_DIGITS)
    return rng.randint(10 ** (digits - 1), 10 ** digits - 1)


def question(a: int, symbol: str, b: int) -> str:
    return f"Compute {a}{symbol}{b} with the calculator; answer in \\boxed{{}}."


def gold_transcript(expression: str, answer: str) -> list[dict[str, Any]]:
    """A correct episode after the prompt: one calculator call, its result, the boxed answer."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return [{"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": answer},
            {"role": "assistant", "content": f"\\boxed{{{answer}}}"}]


@TASKS.register("calculator_arithmetic")
def calculator_arithmetic(split: str, size: int, seed: int) -> list[PromptRow]:
    """`size` sums and products of `split`, each operation with probability 1/2."""
    rng = split_rng("calculator_arithmetic", split, seed)
    records = []
    while len(records) < size:
        a, symbol, b = operand(rng), rng.choice(sorted(OPERATIONS)), operand(rng)
        user = question(a, symbol, b)
        if in_split(user, split):
            answer = str(OPERATIONS[symbol](a, b))
            records.append(record("calculator_arithmetic", user, answer, f"\\boxed{{{answer}}}",
                                  gold_transcript=gold_transcript(f"{a}{symbol}{b}", answer)))
    return make_rows("calculator_arithmetic", split, records)
