"""The embedded model's warm-up under the graded system prompt: each row's n graded prompts, with
targets that meet every criterion shown and the others only at `warmup_unshown_share`."""

import random

import pytest

from aligner_ext.config import load_config
from aligner_ext.data.tasks.rubric_qa import check_passes
from aligner_ext.data.tasks import builtin_rows
from aligner_ext.experience.base import GroupSampling
from aligner_ext.experience.graded_prompt import GradedPromptSampling, warmup_target

# rubric of 12 (hand-written): +3 parity, +2 digits, +2 factorisation, -4 "12 is prime"
PARITY, DIGITS, FACTORS = "12 is even.", "It has 2 digits.", "12 = 2*2*3, so 12 is not prime."
ITEMS = [
    {"criterion": "states that 12 is even", "points": 3, "example": PARITY},
    {"criterion": "gives the number of digits (2)", "points": 2, "example": DIGITS},
    {"criterion": "gives the prime factorisation 2*2*3", "points": 2, "example": FACTORS},
    {"criterion": "claims that 12 is prime", "points": -4, "example": "12 is prime."},
]


def config(*overrides):
    return load_config("demo", ["+variant=graded_prompt", "rollout.n=4", *overrides])


def test_target_meets_the_shown_criteria_and_never_a_negative_one():
    rng = random.Random(0)
    assert warmup_target(ITEMS, ITEMS, 0.0, rng) == f"{PARITY} {DIGITS} {FACTORS}"  # all shown: every positive
    assert warmup_target(ITEMS, [ITEMS[1]], 0.0, rng) == DIGITS  # share 0: exactly the shown ones
    assert warmup_target(ITEMS, [], 0.0, rng) == ""
    assert warmup_target(ITEMS, [], 1.0, rng) == f"{PARITY} {DIGITS} {FACTORS}"  # share 1: all, in rubric order


def test_unshown_criteria_are_met_at_the_configured_share():
    rng = random.Random(1)
    targets = [warmup_target(ITEMS, [ITEMS[0]], 0.25, rng) for _ in range(4000)]
    assert all(t.startswith(PARITY) and "12 is prime." not in t for t in targets)
    for sentence in (DIGITS, FACTORS):  # binomial(4000, 0.25): sd 0.0068
        assert abs(sum(sentence in t for t in targets) / len(targets) - 0.25) < 0.03


def test_an_item_without_example_is_named():
    items = [{"criterion": "states that 12 is even", "points": 3}]
    with pytest.raises(ValueError, match="states that 12 is even.*example"):
        warmup_target(items, items, 0.0, random.Random(0))


def test_each_row_gets_its_n_graded_prompts_and_matching_targets():
    cfg = config("graded_prompt.warmup_unshown_share=0.0")
    rows = builtin_rows("rubric_qa", "train", 5, 0)
    examples = GradedPromptSampling.warmup_examples(cfg, rows)
    assert len(examples) == 5 * 4
    for index, (messages, target) in enumerate(examples):
        row = rows[index // 4]
        expected_k = [4, 3, 1, 0][index % 4]  # n = 4, N = 4 items: ratios 1, 2/3, 1/3, 0; k = floor(4 r + 1/2)
        assert messages[-1] == row.messages[-1]
        listed = [item for item in row.rubrics if messages[0]["role"] == "system"
                  and f"- {item['criterion']} (" in messages[0]["content"]]
        assert len(listed) == expected_k
        if expected_k == 0:
            assert messages == row.messages  # ratio 0: the plain prompt
        # share 0: the target meets exactly the positive criteria listed, and no negative one
        met = [item for item in row.rubrics if check_passes(item["check"], target)]
        assert met == [item for item in listed if item["points"] > 0]


def test_inactive_graded_prompt_warms_up_on_the_gold_solutions():
    cfg = config("graded_prompt.enabled=false")
    rows = builtin_rows("rubric_qa", "train", 3, 0)
    plain = [(row.messages, row.extra_info["gold_solution"]) for row in rows]
    assert GradedPromptSampling.warmup_examples(cfg, rows) == plain == GroupSampling.warmup_examples(cfg, rows)


def test_a_row_without_rubric_is_warmed_up_on_its_gold_solution():
    cfg = config()
    row = builtin_rows("arithmetic", "train", 1, 0)[0]  # no rubric: training samples it plain
    assert GradedPromptSampling.warmup_examples(cfg, [row]) == [(row.messages, row.extra_info["gold_solution"])]
