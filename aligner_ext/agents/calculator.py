"""`calculator`: a tool that evaluates integer arithmetic exactly, and the environment that offers it.

The tool reads `+ - * /`, parentheses and non-negative integer literals (signs allowed) through `ast`,
evaluating only those nodes: nothing is `eval`ed, and anything else (names, calls, powers, floats,
`//`) is refused. It computes with `fractions.Fraction`, so products of 9-digit numbers, past
float64's 2**53, stay exact; a result that is not whole is written as a fraction, e.g. "7/2". A bad
expression raises, and the tool runner shows the model the error (`Error: calculator raised
ValueError: ...`) and counts it under `exception`.

The environment `calculator` serves the `calculator_arithmetic` task (data/tasks): its score is
`math_verify` (rewards/math_answer.py) over the final answer, 1.0 when the last `\\boxed{}` of the
episode's last turn equals the ground truth, else 0.0.
"""

from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction

from aligner_ext.agents.environment import register_environment
from aligner_ext.agents.tool_environment import ToolEnvironment, ToolEpisode
from aligner_ext.rewards.base import RewardResult
from aligner_ext.rewards.math_answer import math_verify_reward

MAX_EXPRESSION_CHARS = 200  # longer expressions are refused: the result's size stays bounded by the input's
ALLOWED_CHARACTERS = re.compile(r"[0-9+\-*/()\s]*")  # ASCII digits only: no hex, underscores, exponents or floats
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers exactly.

    Args:
        expression: Integers with + - * / and parentheses, e.g. "(123456 + 789) * 12".
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    if not ALLOWED_CHARACTERS.fullmatch(expression):
        raise ValueError("use only integers, + - * / and parentheses")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an arithmetic expression: {err.msg}") from None
    value = _evaluate(tree.body)
    return str(value.numerator) if value.denominator == 1 else str(value)


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
        return UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ZeroDivisionError("division by zero")
        return BINARY[type(node.op)](left, right)
    raise ValueError(f"{ast.unparse(node)!r} is not arithmetic on integers")


@register_environment("calculator", data_sources=("calculator_arithmetic",))
class CalculatorEnvironment(ToolEnvironment):
    """Arithmetic with a calculator: the final answer is checked against the ground truth."""

    TOOLS = (calculator,)

    def score(self, state: ToolEpisode) -> RewardResult:
        """The reward with whether it was correct, so held-out accuracy is defined."""
        return math_verify_reward(state.answer or "", state.row)
