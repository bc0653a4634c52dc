"""Reward functions chosen by each row's `data_source`, and the manager that runs them in worker processes.

Importing the package registers the built-in functions: `math_verify` (math_answer.py), `exact_match`
and `squad_exact_match` (exact_match.py), `multiple_choice`, `format_boxed` (format.py).
"""

from aligner_ext.rewards.base import DATA_SOURCES, REWARDS, RewardResult, as_result, register_reward
from aligner_ext.rewards.exact_match import extract_answer, normalize_answer, normalize_text
from aligner_ext.rewards.format import boxed_spans, last_boxed
from aligner_ext.rewards.manager import RewardConfig, RewardManager
from aligner_ext.rewards.math_answer import parse_gold
from aligner_ext.rewards.multiple_choice import extract_choice

__all__ = [
    "DATA_SOURCES", "REWARDS", "RewardConfig", "RewardManager", "RewardResult", "as_result", "boxed_spans",
    "extract_answer", "extract_choice", "last_boxed", "normalize_answer", "normalize_text", "parse_gold",
    "register_reward",
]
