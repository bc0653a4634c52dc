"""The built-in reward functions, called directly (no worker processes), on hand-checked cases."""

import numpy as np
import pytest

from aligner_ext.data.types import PromptRow
from aligner_ext.registry import Registry
from aligner_ext.rewards import base
from aligner_ext.rewards.base import DATA_SOURCES, REWARDS, RewardResult, as_result, register_reward
from aligner_ext.rewards.exact_match import extract_answer, normalize_answer, normalize_text
from aligner_ext.rewards.format import boxed_spans, last_boxed
from aligner_ext.rewards.multiple_choice import extract_choice


def row(ground_truth, data_source="test"):
    return PromptRow(row_id="test.jsonl:0", messages=[{"role": "user", "content": "q"}], data_source=data_source,
                     ground_truth=ground_truth)


def score(name, response, ground_truth):
    return REWARDS.get(name)(response, row(ground_truth))


# --- math_verify -------------------------------------------------------------------------------

@pytest.mark.parametrize("response, gold, expected", [
    ("\\boxed{19}", "19", 1.0),
    ("\\boxed{20}", "19", 0.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),  # equal value, different form
    ("\\boxed{(x-2)(x+2)}", "x^2-4", 1.0),  # symbolic equality
    ("So it is $\\frac{38}{2}$", 19, 1.0),  # numeric ground truth, unboxed answer
    ("\\boxed{19}", "$19$", 1.0),  # ground truth already in a math environment
    ("I am not sure.", "19", 0.0),  # no answer at all
    ("", "19", 0.0),
    ("\\boxed{19}, and the final answer is 20", "19", 1.0),  # the boxed answer wins over the last phrase
])
def test_math_verify(response, gold, expected):
    result = score("math_verify", response, gold)
    assert (result.score, result.correct) == (expected, expected)


@pytest.mark.parametrize("response, strict, lenient", [
    ("12+1", 0.0, 1.0),  # the question's own expression: not an answer, but it evaluates to 13
    ("13", 0.0, 1.0),  # a plain number is an answer only for the lenient variant
    ("12+1=13\n\\boxed{13}", 1.0, 1.0),
    ("12+1=13\n\\boxed{12}", 0.0, 0.0),  # the boxed answer decides, not the working before it
])
def test_math_verify_takes_only_marked_answers_unless_lenient(response, strict, lenient):
    assert score("math_verify", response, "13").score == strict
    assert score("math_verify_lenient", response, "13").score == lenient


@pytest.mark.parametrize("gold", [None, "", "  "])
def test_math_verify_rejects_missing_or_unparseable_ground_truth(gold):
    with pytest.raises(ValueError, match="ground_truth"):
        score("math_verify", "\\boxed{19}", gold)


# --- exact_match / squad_exact_match -----------------------------------------------------------

@pytest.mark.parametrize("response, gold, expected", [
    ("She sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),  # GSM8K's own answer line
    ("#### 1,234", "1234", 1.0),  # thousands separator
    ("#### $72", "72", 1.0),
    ("first #### 5 then #### 72", "72", 1.0),  # the last one counts
    ("#### 71", "72", 0.0),
    ("no marker, but \\boxed{72}", "72", 1.0),  # falls back to the boxed answer
    ("72", "72", 0.0),  # a bare number is no marked answer
    ("#### 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),  # a whole GSM8K solution as ground truth
])
def test_gsm8k_reads_the_number_after_the_hashes(response, gold, expected):
    assert score("gsm8k", response, gold).score == expected


def test_verl_and_ruscarl_data_sources_have_a_reward_by_default():
    import aligner_ext.plugins  # noqa: F401 - registers every built-in reward and its data sources

    assert {source: DATA_SOURCES[source] for source in ("gsm8k", "openai/gsm8k", "hotpot", "healthbench")} == {
        "gsm8k": "gsm8k", "openai/gsm8k": "gsm8k", "hotpot": "squad_exact_match", "healthbench": "rubric_judge"}


def test_normalisations():
    assert normalize_text(" The  Cat. ") == "the cat"
    assert normalize_text("3.5") == "3.5"  # only a trailing period goes
    assert normalize_answer("The  Cat, sat!") == "cat sat"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theory") == "theory"  # articles only as whole words


def test_answer_extraction_order():
    assert extract_answer("x \\boxed{Lyon} <answer>Paris</answer>") == "Lyon"  # boxed first
    assert extract_answer("<answer>Rome</answer> then <answer>Paris</answer>") == "Paris"  # last tag
    assert extract_answer("just Paris") == "just Paris"  # else the whole response


@pytest.mark.parametrize("name, response, gold, expected", [
    ("exact_match", "The answer is \\boxed{ Paris. }", "paris", 1.0),
    ("exact_match", "<answer>New   York</answer>", "new york", 1.0),
    ("exact_match", "Paris", "Paris.", 1.0),
    ("exact_match", "\\boxed{Lyon} <answer>Paris</answer>", "Paris", 0.0),
    ("exact_match", "\\boxed{the Paris}", "Paris", 0.0),  # no article removal here...
    ("squad_exact_match", "\\boxed{the Paris}", "Paris", 1.0),  # ...but SQuAD drops it
    ("squad_exact_match", "\\boxed{red!}", "Red", 1.0),
    ("squad_exact_match", "\\boxed{blue}", "red", 0.0),
    ("exact_match", "\\boxed{new york}", ["NYC", "New York"], 1.0),  # any of several answers
    ("exact_match", "\\boxed{42}", 42, 1.0),  # numbers compare as text
])
def test_exact_match(name, response, gold, expected):
    result = score(name, response, gold)
    assert (result.score, result.correct) == (expected, expected)


def test_exact_match_needs_ground_truth():
    with pytest.raises(ValueError, match="ground_truth"):
        score("exact_match", "Paris", None)


# --- multiple_choice ---------------------------------------------------------------------------

@pytest.mark.parametrize("response, expected", [
    ("\\boxed{B}", "B"),
    ("\\boxed{\\text{(C)}}", "C"),
    ("\\boxed{b}", "B"),
    ("Answer: D", "D"),
    ("The answer is (A).", "A"),
    ("the answer is **E**", "E"),
    ("Vitamin C helps. Answer: B, not C", "B"),  # the answer phrase, not the last letter
    ("so I pick (B)", "B"),
    ("J", "J"),
    ("Answer: Apple", None),  # a word starting with A is not a choice
    ("No idea", None),
])
def test_choice_extraction(response, expected):
    assert extract_choice(response) == expected


@pytest.mark.parametrize("response, gold, expected", [
    ("Answer: B", "B", 1.0),
    ("Answer: B", "(b)", 1.0),
    ("Answer: C", "B", 0.0),
    ("I cannot tell", "B", 0.0),
])
def test_multiple_choice(response, gold, expected):
    result = score("multiple_choice", response, gold)
    assert (result.score, result.correct) == (expected, expected)


@pytest.mark.parametrize("gold", [None, "banana", "K"])
def test_multiple_choice_rejects_a_ground_truth_that_is_not_a_letter(gold):
    with pytest.raises(ValueError, match="not one letter A-J"):
        score("multiple_choice", "Answer: B", gold)


# --- format_boxed ------------------------------------------------------------------------------

def test_boxed_spans_match_nested_braces_and_skip_unclosed():
    text = "a \\boxed{\\frac{1}{2}} b \\boxed{3"
    assert boxed_spans(text) == [(2, 21, "\\frac{1}{2}")]  # "\boxed{" starts at 2; 7 + 11 + 1 chars
    assert last_boxed("\\boxed{1} and \\boxed {2}") == "2"
    assert last_boxed("no box") is None


@pytest.mark.parametrize("response, expected", [
    ("so \\boxed{19}.", 1.0),
    ("so $\\boxed{19}$. </answer>", 1.0),  # "$.</answer>" = 11 non-space characters after it
    ("\\boxed{19}" + "x" * 20, 1.0),  # 20 characters after it: the most allowed
    ("\\boxed{19}" + "x" * 21, 0.0),
    ("\\boxed{1} then \\boxed{2}", 0.0),  # two answers
    ("no box at all", 0.0),
    ("\\boxed{19", 0.0),  # unclosed
])
def test_format_boxed(response, expected):
    result = score("format_boxed", response, None)
    assert result.score == expected
    assert result.correct is None


# --- registry and return values ----------------------------------------------------------------

def test_builtin_data_sources():
    assert DATA_SOURCES["arithmetic"] == "math_verify"
    assert DATA_SOURCES["gsm8k"] == "gsm8k"  # the number after "####", else the boxed answer
    assert DATA_SOURCES["MATH"] == "math_verify"
    assert DATA_SOURCES["short_qa"] == "squad_exact_match"
    assert DATA_SOURCES["multiple_choice"] == "multiple_choice"
    assert DATA_SOURCES["rubric_qa"] == "rubric"  # the built-in task's items carry check specs for the rule grader


def test_register_reward_refuses_a_data_source_mapped_twice(monkeypatch):
    monkeypatch.setattr(base, "REWARDS", Registry("reward function"))
    monkeypatch.setattr(base, "DATA_SOURCES", {})
    register_reward("first", data_sources=("src",))(lambda response, row: 1.0)
    assert base.DATA_SOURCES == {"src": "first"}
    with pytest.raises(ValueError, match="'src' is mapped to both 'first' and 'second'"):
        register_reward("second", data_sources=("src",))(lambda response, row: 0.0)


def test_as_result():
    assert as_result(1) == RewardResult(score=1.0, correct=None)
    assert as_result(np.float32(0.5)) == RewardResult(score=0.5, correct=None)
    kept = RewardResult(score=0.25, correct=1.0, info={"k": 1})
    assert as_result(kept) is kept
    with pytest.raises(TypeError, match="returned str"):
        as_result("1.0")
    with pytest.raises(ValueError, match="finite"):
        as_result(float("inf"))
    with pytest.raises(ValueError, match="finite"):
        as_result(RewardResult(score=float("nan")))


@pytest.mark.parametrize("name, responses, gold, answers", [
    ("math_verify", [r"\boxed{\frac{1}{2}}", r"\boxed{\frac12}", r"\boxed{0.5}", r"\boxed{(x+1)^2}", "no answer"],
     "1/2", ["1/2", "1/2", "1/2", "(x + 1)**2", None]),
    ("gsm8k", ["so #### 1,042", r"\boxed{7}"], "1042", ["1042", "7"]),
    ("exact_match", [r"\boxed{ The Cat. }", "<answer>dog</answer>", "plain text"], "the cat",
     ["the cat", "dog", "plain text"]),
    ("squad_exact_match", [r"\boxed{The cat!}"], "cat", ["cat"]),
    ("multiple_choice", [r"\boxed{(b)}", "Answer: C", "no letter here"], "B", ["B", "C", None]),
])
def test_rewards_with_answer_extraction_report_the_answer_they_compared(name, responses, gold, answers):
    assert REWARDS.get(name).extracts_answer
    assert [as_result(REWARDS.get(name)(response, row(gold))).answer for response in responses] == answers


def test_a_reward_without_answer_extraction_says_so():
    assert not getattr(REWARDS.get("format_boxed"), "extracts_answer", False)
    assert as_result(REWARDS.get("format_boxed")(r"\boxed{1}", row("1"))).answer is None
