"""MTPO segment rewards: confidence parsing edge cases, the segment format checks, the calibration
term, and what an unparseable confidence and an unclosed round-1 answer earn."""

import pytest

from aligner_ext.data.types import PromptRow
from aligner_ext.rewards.base import DATA_SOURCES, REWARDS
from aligner_ext.rewards.calibration import (
    SegmentRewards,
    calibration_reward,
    format_answer_segment,
    format_confidence_segment,
    format_confidence_segment_lenient,
    parse_confidence,
)

ROW = PromptRow(row_id="t:0", messages=[{"role": "user", "content": "q"}], data_source="short_qa", ground_truth="red")


@pytest.mark.parametrize("text, expected", [
    ("<confidence>0.7</confidence>", 0.7),
    ("<analysis>x</analysis><confidence> 1 </confidence>", 1.0),
    ("<confidence>0</confidence>", 0.0),
    ("<confidence>.25</confidence>", 0.25),
    ("<confidence>1.</confidence>", 1.0),
    ("<confidence>5e-1</confidence>", 0.5),
    ("<confidence>0.2</confidence> then <confidence>0.9</confidence>", 0.9),  # the last tag counts
    ("<confidence>0.9</confidence><confidence>high</confidence>", None),  # the last tag is not a number
    ("<confidence>70%</confidence>", None),
    ("<confidence>0.7!</confidence>", None),
    ("<confidence>1.5</confidence>", None),  # outside [0, 1]
    ("<confidence>-0.1</confidence>", None),
    ("<confidence>nan</confidence>", None),
    ("<confidence>inf</confidence>", None),
    ("<confidence></confidence>", None),
    ("<confidence>0.7", None),  # not closed
    ("0.7", None),  # no tag
])
def test_parse_confidence_edge_cases(text, expected):
    assert parse_confidence(text) == expected


def test_calibration_reward_by_hand():
    assert calibration_reward(0.8, 1.0) == pytest.approx(0.96)  # 1 - 0.2^2
    assert calibration_reward(0.8, 0.0) == pytest.approx(0.36)  # 1 - 0.8^2
    assert calibration_reward(1.0, 0.0) == 0.0
    assert calibration_reward(0.0, 0.0) == 1.0
    assert calibration_reward(None, 1.0) == 0.0 and calibration_reward(None, 0.0) == 0.0


@pytest.mark.parametrize("text, ok", [
    ("<think>a</think><answer>red</answer>", True),
    ("\n<think>a\nb</think>\n <answer>red</answer>\n", True),  # whitespace around tags, multi-line think
    ("<answer>red</answer>", False),  # no think
    ("<think>a</think>", False),  # no answer
    ("so <think>a</think><answer>red</answer>", False),  # text before the think
    ("<think>a</think><answer>red", False),  # answer not closed
    ("<THINK>a</THINK><ANSWER>red</ANSWER>", False),  # tags are case-sensitive
])
def test_format_answer_segment(text, ok):
    assert format_answer_segment(text, ROW).score == float(ok)


@pytest.mark.parametrize("text, strict, lenient", [
    ("<analysis>sure</analysis><confidence>0.9</confidence>", 1.0, 1.0),
    ("\n<analysis>a</analysis>\n<confidence>0.1</confidence>\n", 1.0, 1.0),
    ("<confidence>0.9</confidence>", 0.0, 1.0),  # <analysis> required by the strict check only
    ("<analysis>a</analysis><confidence>high</confidence>", 0.0, 0.0),  # unparseable value
    ("<analysis>a</analysis><confidence>1.2</confidence>", 0.0, 0.0),
    ("<analysis>a</analysis><confidence>0.9</confidence> extra", 0.0, 0.0),
    ("<analysis>a</analysis>", 0.0, 0.0),
    ("", 0.0, 0.0),
])
def test_format_confidence_segment_strict_and_lenient(text, strict, lenient):
    assert format_confidence_segment(text, ROW).score == strict
    assert format_confidence_segment_lenient(text, ROW).score == lenient


def test_segment_functions_are_registered_and_hotpotqa_is_graded_by_squad_match():
    assert REWARDS.get("format_answer_segment") is format_answer_segment
    assert REWARDS.get("format_confidence_segment") is format_confidence_segment
    assert REWARDS.get("format_confidence_segment_lenient") is format_confidence_segment_lenient
    assert DATA_SOURCES["hotpotqa"] == "squad_exact_match"


def test_segment_rewards_weights_by_hand():
    rewards = SegmentRewards(SegmentRewards.Config(correctness_weight=1.0, answer_format_weight=0.5,
                                                   calibration_weight=2.0, confidence_format_weight=0.25))
    answer = "<think>t</think><answer>red</answer>"
    # right answer, well-formed, confidence 0.8: R_ans = 1 + 0.5; R_conf = 2 * (1 - 0.04) + 0.25
    s = rewards.score(ROW, answer, 1.0, 1.0, "<analysis>a</analysis><confidence>0.8</confidence>")
    assert s.answer_reward == pytest.approx(1.5) and s.confidence_reward == pytest.approx(2.17)
    assert (s.answer_format, s.confidence_format, s.confidence) == (1.0, 1.0, 0.8)
    # wrong answer without think, confidence without analysis: R_ans = 0 + 0; R_conf = 2 * (1 - 0.64) + 0
    s = rewards.score(ROW, "<answer>blue</answer>", 0.0, 0.0, "<confidence>0.8</confidence>")
    assert s.answer_reward == 0.0 and s.confidence_reward == pytest.approx(0.72)


def test_unparseable_confidence_earns_zero_calibration_and_zero_format():
    rewards = SegmentRewards(SegmentRewards.Config())
    for text in ("<analysis>a</analysis><confidence>very</confidence>", "<analysis>a</analysis>", "", None):
        s = rewards.score(ROW, "<think>t</think><answer>red</answer>", 1.0, 1.0, text)
        assert s.confidence is None and s.calibration == 0.0 and s.confidence_reward == 0.0
        assert s.answer_reward == pytest.approx(1.5)  # the answer side does not depend on round 2


def test_unclosed_round_one_answer_earns_nothing_on_either_side():
    rewards = SegmentRewards(SegmentRewards.Config())
    s = rewards.score(ROW, "<think>t</think><answer>red", None, 0.0, None)
    terms = (s.answer_reward, s.confidence_reward, s.answer_format, s.confidence_format, s.calibration)
    assert terms == (0, 0, 0, 0, 0)
    assert s.confidence is None


def test_lenient_format_is_chosen_by_name_and_unknown_names_fail():
    lenient = SegmentRewards(SegmentRewards.Config(confidence_format="format_confidence_segment_lenient"))
    s = lenient.score(ROW, "<think>t</think><answer>red</answer>", 1.0, 1.0, "<confidence>1</confidence>")
    assert s.confidence_format == 1.0 and s.confidence_reward == pytest.approx(1.0 + 0.5)
    with pytest.raises(KeyError, match="format_nope"):
        SegmentRewards(SegmentRewards.Config(answer_format="format_nope"))


def test_format_function_outside_unit_range_is_an_error(monkeypatch):
    rewards = SegmentRewards(SegmentRewards.Config())
    monkeypatch.setattr(rewards, "answer_format_fn", lambda text, row: 2.0)
    with pytest.raises(ValueError, match=r"format_answer_segment.*t:0.*\[0, 1\]"):
        rewards.score(ROW, "x</answer>", 1.0, 1.0, "")
