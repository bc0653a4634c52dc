"""The built-in tasks built for the variants' comparisons (docs/learning.md): mixed_arithmetic (dynamic
sampling), number_facts (graded system prompt), chain_sums and three_digit_sums (CPO). Rows and rewards checked by hand."""

import dataclasses
import re
from collections import Counter

import pytest

import aligner_ext.plugins  # noqa: F401 - registers the reward functions
from aligner_ext.data.tasks import builtin_rows, sft_target
from aligner_ext.data.tasks.number_facts import rubric
from aligner_ext.data.tasks.rubric_qa import check_passes
from aligner_ext.rewards.base import DATA_SOURCES, REWARDS


def reward(row, response):
    """The score of `response` by the reward the row's data_source maps to."""
    return REWARDS.get(DATA_SOURCES[row.data_source])(response, row).score


def terms(row):
    return [int(x) for x in re.fullmatch(r"(\d+(?:\+\d+)+)=", row.messages[0]["content"]).group(1).split("+")]


def test_mixed_arithmetic_draws_a_third_of_each_difficulty_from_its_range():
    rows = builtin_rows("mixed_arithmetic", "train", 900, seed=0)
    counts = Counter(row.extra_info["difficulty"] for row in rows)
    assert set(counts) == {"easy", "medium", "hard"}
    assert all(240 <= count <= 360 for count in counts.values())  # binomial(900, 1/3): mean 300, sd 14
    kinds = {"easy": ("+", 0, 9), "medium": ("+", 0, 20), "hard": ("*", 100, 999)}
    for row in rows:
        a, symbol, b = re.fullmatch(r"(\d+)([+*])(\d+)=", row.messages[0]["content"]).groups()
        a, b = int(a), int(b)
        expected_symbol, low, high = kinds[row.extra_info["difficulty"]]
        assert symbol == expected_symbol and low <= a <= high and low <= b <= high
        result = a + b if symbol == "+" else a * b
        assert row.ground_truth == str(result)
        assert sft_target(row) == f"{a}{symbol}{b}={result}\n\\boxed{{{result}}}"


@pytest.mark.parametrize("response, score", [
    ("418*276=115368\n\\boxed{115368}", 1.0),  # 418 * 276 = 83600 + 31768
    ("\\boxed{115368}", 1.0),
    ("418*276=115358\n\\boxed{115358}", 0.0),
    ("418*276=115368", 0.0),  # an unmarked answer is not read
])
def test_mixed_arithmetic_reward_is_the_boxed_result(response, score):
    row = builtin_rows("mixed_arithmetic", "val", 1, seed=0)[0]
    row = dataclasses.replace(row, messages=[{"role": "user", "content": "418*276="}], ground_truth="115368")
    assert reward(row, response) == score


def test_chain_sums_gold_adds_one_term_per_line():
    rows = builtin_rows("chain_sums", "train", 300, seed=0)
    assert rows[1].messages[0]["content"] == "85+21+8="
    assert sft_target(rows[1]) == "85+21=106\n106+8=114\n\\boxed{114}"
    assert reward(rows[1], "85+21=106\n106+8=114\n\\boxed{114}") == 1.0
    assert reward(rows[1], "85+21=96\n96+8=104\n\\boxed{104}") == 0.0  # a carry lost in the first step
    for row in rows:
        a, b, c = terms(row)
        assert all(0 <= x <= 99 for x in (a, b, c))
        assert row.ground_truth == str(a + b + c)
        assert sft_target(row) == f"{a}+{b}={a + b}\n{a + b}+{c}={a + b + c}\n\\boxed{{{a + b + c}}}"


def test_three_digit_sums_gold_is_one_line_and_the_answer():
    rows = builtin_rows("three_digit_sums", "train", 300, seed=0)
    assert rows[0].messages[0]["content"] == "530+891="
    assert sft_target(rows[0]) == "530+891=1421\n\\boxed{1421}"
    assert reward(rows[0], "530+891=1421\n\\boxed{1421}") == 1.0
    assert reward(rows[0], "530+891=1321\n\\boxed{1321}") == 0.0  # the hundreds' carry lost
    for row in rows:
        a, b = terms(row)
        assert 0 <= a <= 999 and 0 <= b <= 999 and row.ground_truth == str(a + b)
        assert sft_target(row) == f"{a}+{b}={a + b}\n\\boxed{{{a + b}}}"
    assert max(max(terms(row)) for row in rows) >= 900  # three-digit terms, not chain_sums' two


def test_number_facts_rubric_of_418():
    items = rubric(418)
    assert [(item["criterion"], item["points"], item["check"]["value"], item["example"]) for item in items] == [
        ("states that 418 is even", 1, "418 is even", "418 is even."),
        ("gives the number of digits (3)", 1, "3 digits", "It has 3 digits."),
        ("gives the last digit (8)", 1, "last digit is 8", "Its last digit is 8."),
        ("gives the first digit (4)", 1, "first digit is 4", "Its first digit is 4."),
        ("says that 418 is less than 500", 1, "418 is less than 500", "418 is less than 500."),
    ]
    assert [item["check"]["value"] for item in rubric(57)] == [
        "57 is odd", "2 digits", "last digit is 7", "first digit is 5", "57 is less than 500"]
    assert rubric(500)[4]["check"]["value"] == "500 is at least 500"


@pytest.mark.parametrize("response, score", [
    ("418 is even.", 0.2),  # the gold solution: one fact in five
    ("418 is even. It has 3 digits. Its last digit is 8. Its first digit is 4. 418 is less than 500.", 1.0),
    ("It has 3 digits. Its first digit is 4.", 0.4),
    ("418 is odd. Its last digit is 4. It has 2 digits.", 0.0),  # wrong facts earn nothing
    ("1418 is even. Its last digit is 88.", 0.0),  # whole words only
])
def test_number_facts_reward_is_the_share_of_facts_stated(response, score):
    row = next(r for r in builtin_rows("number_facts", "val", 200, seed=0) if r.extra_info["number"] == 418)
    assert row.messages == [{"role": "user", "content": "List facts about 418."}]
    assert row.ground_truth is None and sft_target(row) == "418 is even."
    assert reward(row, response) == pytest.approx(score)


def test_number_facts_examples_meet_their_own_item_only():
    for row in builtin_rows("number_facts", "train", 200, seed=0):
        assert 10 <= row.extra_info["number"] <= 999
        for item in row.rubrics:
            # so a warm-up target meets exactly the items it was built from
            assert [check_passes(other["check"], item["example"]) for other in row.rubrics] == [
                other is item for other in row.rubrics]
