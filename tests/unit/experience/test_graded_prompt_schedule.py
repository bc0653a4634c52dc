"""Graded system prompt, the pure parts: per-sample ratios, step decay, subset sizes and subsets,
the system message text, merging with a row's own system message, activation, config checks."""

import math
import random

import pytest

from aligner_ext.config import load_config
from aligner_ext.experience.base import RolloutConfig
from aligner_ext.experience.graded_prompt import (
    GradedPromptConfig,
    choose_criteria,
    generation_messages,
    group_ratio,
    inactive_reason,
    num_shown,
    step_factor,
    system_message,
)


def ratios(n, **cfg):
    return [group_ratio(i, n, GradedPromptConfig(**cfg)) for i in range(n)]


# --- ratios -----------------------------------------------------------------------------------------

def test_linear_ratios_for_n_2_3_8():
    assert ratios(2) == [1.0, 0.0]
    assert ratios(3) == [1.0, 0.5, 0.0]
    expected = [7 / 7, 6 / 7, 5 / 7, 4 / 7, 3 / 7, 2 / 7, 1 / 7, 0 / 7]  # (n-1-i)/(n-1), n = 8
    assert ratios(8) == pytest.approx(expected, abs=1e-15)
    assert ratios(1) == [1.0]  # a group of one sees everything (RuscaRL)


def test_binary_rule_reveals_everything_to_the_first_k_samples():
    assert ratios(4, rule="binary", full_reveal_count=1) == [1.0, 0.0, 0.0, 0.0]
    assert ratios(4, rule="binary", full_reveal_count=3) == [1.0, 1.0, 1.0, 0.0]
    assert ratios(3, rule="binary", full_reveal_count=0) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("decay, step, expected", [
    ("none", 3, 1.0),
    ("linear", 0, 1.0), ("linear", 1, 0.75), ("linear", 2, 0.5), ("linear", 4, 0.0),  # 1 - step / 4
    ("power", 2, 0.25),  # (1 - 2/4)^2
    ("sigmoid", 2, 0.5),  # x = 0.5 = x0
    ("sigmoid", 0, 1 / (1 + math.exp(-5.0))),  # x = 0: 1 / (1 + e^(10 * (0 - 0.5)))
    ("sigmoid", 4, 1 / (1 + math.exp(5.0))),
])
def test_step_decay_over_five_steps(decay, step, expected):
    cfg = GradedPromptConfig(step_decay=decay, step_power=2.0, sigmoid_start_point=0.5, sigmoid_steepness=10.0)
    assert step_factor(step, 5, cfg) == pytest.approx(expected, rel=1e-12)


def test_step_decay_is_one_for_a_single_step_run_and_steep_sigmoids_do_not_overflow():
    assert step_factor(0, 1, GradedPromptConfig(step_decay="linear")) == 1.0
    steep = GradedPromptConfig(step_decay="sigmoid", sigmoid_start_point=0.2, sigmoid_steepness=1e4)
    assert step_factor(9, 10, steep) == 0.0
    assert step_factor(0, 10, steep) == 1.0


# --- subset sizes and subsets -------------------------------------------------------------------------

def test_subset_sizes_round_half_up():
    # N = 4 criteria, n = 8: 4 * (7..0)/7 = 4, 3.43, 2.86, 2.29, 1.71, 1.14, 0.57, 0
    assert [num_shown(4, r) for r in ratios(8)] == [4, 3, 3, 2, 2, 1, 1, 0]
    assert [num_shown(4, r) for r in ratios(3)] == [4, 2, 0]
    assert num_shown(5, 0.5) == 3  # 2.5 -> 3 (Python's round() would give 2)
    assert num_shown(1, 0.5) == 1  # 0.5 -> 1 (round() would give 0)
    assert num_shown(3, 0.1) == 0  # 0.3 -> 0: a positive ratio can show nothing
    # ratio 1 x linear decay at step 5 of 7 = 1 - 5/6 = 1/6: 3 * 1/6 = 1/2 exactly, 0.4999999999999999 in floats
    decayed = 1.0 * step_factor(5, 7, GradedPromptConfig(step_decay="linear"))
    assert 3 * decayed < 0.5 and num_shown(3, decayed) == 1


def test_subset_is_a_seeded_random_subset_in_rubric_order():
    items = [{"criterion": c, "points": 1} for c in "abcdef"]
    picked = [choose_criteria(items, 3, random.Random(f"seed/{i}")) for i in range(20)]
    for subset in picked:
        letters = [item["criterion"] for item in subset]
        assert len(letters) == 3 and letters == sorted(letters) and len(set(letters)) == 3
    assert len({tuple(i["criterion"] for i in s) for s in picked}) > 1  # not always the same (not a prefix)
    assert choose_criteria(items, 3, random.Random("seed/0")) == picked[0]  # deterministic per seed
    assert choose_criteria(items, 0, random.Random(0)) == []
    assert choose_criteria(items, 6, random.Random(0)) == items


# --- the message ---------------------------------------------------------------------------------------

ITEMS = [
    {"criterion": "states that 12 is even", "points": 3},
    {"criterion": "claims that 12 is prime", "points": -4},
    {"criterion": "gives the number of digits (2)", "points": 2.5},
]


def test_default_message_lists_include_and_avoid_points_with_the_warning():
    expected = (
        "You are a helpful assistant. For this question, please consider the following evaluation criteria:\n\n"
        "IMPORTANT POINTS TO INCLUDE (you should aim to address these):\n"
        "Criterion 1: states that 12 is even (worth 3 points)\n"
        "Criterion 2: gives the number of digits (2) (worth 2.5 points)\n\n"
        "IMPORTANT POINTS TO AVOID (you should not do these):\n"
        "Criterion 1: claims that 12 is prime (penalty: 4 points)\n\n"
        "Please provide a comprehensive and helpful response that addresses the user's concerns while "
        "following the above guidelines.\n\n"
        "IMPORTANT: Do not mention or reference these evaluation criteria in your response. Do not indicate that "
        "you have seen any scoring rubric or evaluation guidelines. Your response should appear natural and "
        "spontaneous. Revealing that you have access to evaluation criteria would be considered cheating and is "
        "strictly prohibited."
    )
    assert system_message(ITEMS, GradedPromptConfig()) == expected


def test_compact_message_without_warning_and_with_only_positive_items():
    cfg = GradedPromptConfig(header="", include_heading="Include:", include_item="- {criterion} (+{points})",
                             footer="", include_evaluation_warning=False)
    assert system_message(ITEMS[:1], cfg) == "Include:\n- states that 12 is even (+3)"


def test_no_criterion_gives_no_system_message_or_the_base_prompt():
    assert system_message([], GradedPromptConfig()) is None
    assert system_message([], GradedPromptConfig(base_when_zero=True, base_system_prompt="Be brief.")) == "Be brief."


def test_a_rows_own_system_message_is_kept_and_merged():
    user = {"role": "user", "content": "q"}
    assert generation_messages([user], "S", "append") == [{"role": "system", "content": "S"}, user]
    own = {"role": "system", "content": "You are a doctor."}
    assert generation_messages([own, user], "S", "append") == [
        {"role": "system", "content": "You are a doctor.\n\nS"}, user]
    assert generation_messages([own, user], "S", "prepend") == [
        {"role": "system", "content": "S\n\nYou are a doctor."}, user]


# --- activation and config ---------------------------------------------------------------------------------

def test_activation_conditions():
    on = GradedPromptConfig(enabled=True)
    assert inactive_reason(on, RolloutConfig(n=4, temperature=0.7)) is None
    assert "enabled is false" in inactive_reason(GradedPromptConfig(), RolloutConfig(n=4))
    assert "greedy" in inactive_reason(on, RolloutConfig(n=4, temperature=0.0))
    assert "rollout.n is 1" in inactive_reason(on, RolloutConfig(n=1))


@pytest.mark.parametrize("override, message", [
    ("graded_prompt.rule=step_sigmoid", "^graded_prompt.rule='step_sigmoid': must be one of linear, binary$"),
    ("graded_prompt.step_decay=cosine", "^graded_prompt.step_decay='cosine': must be one of none, linear, power, sigmoid$"),
    ("graded_prompt.existing_system=replace", "^graded_prompt.existing_system='replace': must be one of append, prepend$"),
    ("graded_prompt.full_reveal_count=-1", "^graded_prompt.full_reveal_count=-1: must be a finite number >= 0$"),
    ("graded_prompt.step_power=0.0", "^graded_prompt.step_power=0: must be a finite number > 0$"),
    ("graded_prompt.include_item='{name}: {points}'", r"graded_prompt.include_item may use only"),
])
def test_bad_config_is_named(override, message):
    with pytest.raises(ValueError, match=message):
        load_config("base", [override])
