"""Built-in synthetic tasks, generated locally from a seed: importing this package registers them."""

from aligner_ext.data.tasks import arithmetic, rubric_qa, short_qa  # noqa: F401  (registers the tasks)
from aligner_ext.data.tasks.base import TASKS, builtin_rows, sft_target

__all__ = ["TASKS", "builtin_rows", "sft_target"]
