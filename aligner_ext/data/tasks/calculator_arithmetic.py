"""`calculator_arithmetic`: a sum or a product of two 3-digit integers, to answer with a calculator.

Example: "Compute 482*502 with the calculator; answer in \\boxed{}." -> ground truth "241964".
Products of 3-digit numbers are beyond what the built-in tiny model multiplies digit by digit, so its
accuracy shows whether it learned to call the `calculator` tool (agents/calculator.py, the environment
registered for this data_source). Without the environment the rows are scored by `math_verify` as
`arithmetic` is, the same task without the tool.

The gold solution is the boxed answer alone, "\\boxed{241964}": the tool call that leads
to it is written in the model family's own syntax, which a task does not know. The whole correct
episode is in `extra_info.gold_transcript` as OpenAI messages (the call, the tool's result, the boxed
answer), which the chat template renders in the family's syntax: the supervised warm-up of agent
episodes teaches it (experience/agent_episodes.py).

The problem space is large (1.6 million problems), so rows are drawn at random and kept only if their
prompt text belongs to the split (`base.in_split`).

Drills (`DRILLS`): the warm-up on gold transcripts alone leaves the embedded model writing the format
with made-up digits, neither copying the question's numbers into the call nor the tool's result into
the answer (docs/agents.md, "Demo"); boxing numbers read from a user or a tool message first teaches
the copying.
"""

from __future__ import annotations

import operator
import random
from typing import Any

from aligner_ext.data.tasks.base import DRILLS, TASKS, in_split, make_rows, record, split_rng
from aligner_ext.data.types import PromptRow

OPERAND_DIGITS = 3
DRILL_DIGITS = (3, 6)  # the lengths of the operands and of the answers (a sum has 3-4 digits, a product 5-6)
OPERATIONS = {"+": operator.add, "*": operator.mul}


def number(rng: random.Random, digits: int) -> int:
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
        a, symbol, b = number(rng, OPERAND_DIGITS), rng.choice(sorted(OPERATIONS)), number(rng, OPERAND_DIGITS)
        user = question(a, symbol, b)
        if in_split(user, split):
            answer = str(OPERATIONS[symbol](a, b))
            records.append(record("calculator_arithmetic", user, answer, f"\\boxed{{{answer}}}",
                                  gold_transcript=gold_transcript(f"{a}{symbol}{b}", answer)))
    return make_rows("calculator_arithmetic", split, records)


@DRILLS.register("calculator_arithmetic")
def copy_drills(count: int, seed: int) -> list[tuple[list[dict[str, str]], str]]:
    """`count` (messages, target) pairs, alternately boxing a number given by the user and by a tool,
    of DRILL_DIGITS' lengths drawn uniformly."""
    rng = random.Random(f"aligner_ext/calculator_arithmetic/drills/{seed}")
    drills = []
    for index in range(count):
        text = str(number(rng, rng.randint(*DRILL_DIGITS)))
        messages = ([{"role": "user", "content": f"{text} with the calculator; answer"}] if index % 2 == 0 else
                    [{"role": "user", "content": "Box it."}, {"role": "tool", "content": text}])
        drills.append((messages, f"\\boxed{{{text}}}"))
    return drills
