"""Settings of the prompt data.

The dataclasses of their config sections, each field with its rule, kept free of torch and of the code
that uses them: composing and checking a configuration (`aligner-ext config`, `load_config`) never
imports a model library (tests/unit/config/test_plugin_names.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from aligner_ext.rules import choice, number, plugin

OVERLONG_POLICIES = ("error", "skip", "truncate_left")
VAL_SET_NAME = re.compile(r"[\w.+-]+")
DEFAULT_VAL_SET = "val"  # the name of the one validation set of data.val_files or the built-in task
PLACEMENTS = ("user_prefix", "reference_prompt", "assistant_turn")
MISSING_POLICIES = ("error", "skip")
TRUNCATE_SIDES = ("left", "right")
PREFIX_TEMPLATE = "{hint}\n"
REFERENCE_TEMPLATE = (  # the public code's prompt, shortened to its instruction
    "###Question: {question}\n###Reference Answer: {hint}\n"
    "Given the above question and its reference answer, produce a step-by-step explanation that logically "
    "leads to the reference answer and put your final answer within \\boxed{}, without mentioning or implying "
    "any prior access to the reference answer."
)
FOLLOWUP_TEMPLATE = "{question}\nPlease refer to the above solution to derive your answer."


@dataclass
class HintConfig:
    """Where the CPO hint goes in the prompt, and what happens to rows without one."""

    placement: str = choice("user_prefix", *PLACEMENTS)  # user_prefix (the CPO guide's) | reference_prompt | assistant_turn
    prefix_template: str = PREFIX_TEMPLATE  # user_prefix: text put before the last user turn's content
    reference_template: str = REFERENCE_TEMPLATE  # reference_prompt: the last user turn's new content
    followup_template: str = FOLLOWUP_TEMPLATE  # assistant_turn: user turn after the assistant turn holding the hint
    missing: str = choice("error", *MISSING_POLICIES)  # row without a hint: error (names the row) | skip (GRPO advantages for it; counted)
    max_hint_length: int = number(0, ge=0)  # hint tokens kept; 0 keeps the whole hint (the batch grows wider instead)
    truncate_side: str = choice("left", *TRUNCATE_SIDES)  # end of an overlong hint that is dropped: left (keeps its answer) | right (the CPO guide's)
    check_insertion: bool = True  # user_prefix / assistant_turn: error unless the hint is one contiguous insertion
    solution_fields: list[str] = field(default_factory=lambda: ["gold_solution", "solution"])  # extra_info fields holding the hint (cpo.gold_as_hint), first non-empty wins; public CPO data uses `solution`
    warmup_share: float = number(0.0, ge=0, le=1)  # embedded-model warm-up only: share of the rows also warmed up on their hinted prompt (the model learns to read a hint); 0: none

    def __post_init__(self) -> None:
        required = {"prefix_template": ("{hint}",), "reference_template": ("{hint}", "{question}"),
                    "followup_template": ("{question}",)}
        for name, placeholders in required.items():
            for placeholder in placeholders:
                if placeholder not in getattr(self, name):
                    raise ValueError(f"cpo.hint.{name} must contain {placeholder}; got {getattr(self, name)!r}")


@dataclass
class DataConfig:
    """Where prompts come from and how they are batched."""

    train_files: list[str] = field(default_factory=list)  # parquet/jsonl training files; empty: the built-in task
    val_files: list[str] = field(default_factory=list)  # validation files, one set; empty: see load_split
    val_sets: dict[str, list[str]] = field(default_factory=dict)  # named validation sets instead of val_files, each added as +data.val_sets.<name>=[files or built-in task names (the task's val split)]; metrics keyed val/<name>/... (docs/evaluation.md)
    builtin_task: str = plugin("arithmetic", "aligner_ext.data.tasks.base:TASKS")  # built-in task name (data/tasks) or dotted path to a task function
    builtin_train_size: int = number(2000, ge=1)  # rows generated for the built-in train split
    builtin_val_size: int = number(200, ge=0)  # rows generated for the built-in val split; 0: no validation
    train_batch_size: int = number(16, ge=1)  # prompts per training step
    val_batch_size: int = number(64, ge=1)  # prompts per validation batch
    max_prompt_length: int = number(256, ge=1)  # longest prompt, in tokens, chat template included
    overlong_prompt: str = choice("error", *OVERLONG_POLICIES)  # longer prompts: error | skip | truncate_left (keep the last tokens)
    shuffle: bool = True  # reshuffle the training rows every epoch
    seed: int = number(0, ge=0)  # seeds the built-in task's rows and the epoch permutations (>= 0)

    def __post_init__(self) -> None:
        if self.val_files and self.val_sets:
            raise ValueError("data.val_files and data.val_sets are both given: name the files of data.val_files as "
                             "one more set of data.val_sets")
        for name, entries in self.val_sets.items():
            if not VAL_SET_NAME.fullmatch(name):
                raise ValueError(f"data.val_sets.{name}: a set's name is part of its metrics' keys (val/<name>/...): "
                                 "letters, digits, '_', '-', '.' and '+' only")
            if not entries:
                raise ValueError(f"data.val_sets.{name} is empty: list its files or built-in task names")


def check_val_set_names(cfg: DataConfig, names: list[str]) -> None:
    """Refuse a name in `names` (trainer.eval.sets) that is not a set of `cfg.val_sets`."""
    unknown = [name for name in names if name not in cfg.val_sets]
    if unknown:
        known = ", ".join(cfg.val_sets) or "none: data.val_sets is empty"
        raise ValueError(f"trainer.eval.sets={list(names)}: {', '.join(unknown)} is not a set of data.val_sets "
                         f"(its sets: {known})")
