"""Built-in synthetic tasks, generated locally from a seed: importing this package registers them."""

from aligner_ext.data.tasks import (  # noqa: F401  (registers the tasks)
    arithmetic, calculator_arithmetic, chain_sums, guess_number, mixed_arithmetic, number_facts, python_digits,
    rubric_qa, short_qa)
from aligner_ext.data.tasks.base import TASKS, builtin_rows, sft_target

__all__ = ["TASKS", "builtin_rows", "sft_target"]
