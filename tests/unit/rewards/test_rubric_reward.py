"""Rubric reward: the HealthBench score with negative points, clipping, the rule grader on rubric_qa's
check specs, verdict parsing, the judge's prompt pieces and metrics, and scoring in a worker process."""

import pytest

from aligner_ext.data.tasks.rubric_qa import rubric_and_gold
from aligner_ext.data.types import PromptRow
from aligner_ext.rewards.base import REWARDS
from aligner_ext.rewards.manager import RewardConfig, RewardManager
from aligner_ext.rewards.rubric import (
    RubricConfig, RubricReward, judge_metrics, load_template, parse_verdict, render_conversation, rubric_line,
    rubric_score,
)


def row(rubrics, number=12):
    return PromptRow(row_id="t.jsonl:5", messages=[{"role": "user", "content": f"Describe the number {number}."}],
                     data_source="rubric_qa", rubrics=rubrics)


def test_score_sums_met_points_over_positive_points():
    points = [3.0, 2.0, 2.0, -4.0]
    assert rubric_score(points, [True, True, True, False]) == 1.0
    assert rubric_score(points, [True, False, True, True]) == pytest.approx((3 + 2 - 4) / 7)
    assert rubric_score(points, [False, False, False, True]) == pytest.approx(-4 / 7)  # negative, unclipped
    assert rubric_score(points, [False] * 4) == 0.0
    with pytest.raises(ValueError, match="no positive points"):
        rubric_score([-1.0], [True])


def test_rule_grader_on_rubric_qa():
    rubric, gold = rubric_and_gold(12)  # +3 "12 is even", +2 "2 digits", +2 "2*2*3", -4 "12 is prime"
    reward = RubricReward(RubricConfig(grader="rule"))
    perfect = reward(gold, row(rubric))
    assert (perfect.score, perfect.correct) == (1.0, 1.0)
    assert perfect.info["criteria_met"] == [True, True, True, False]
    wrong = reward("12 is even. 12 is prime.", row(rubric))
    assert wrong.score == pytest.approx((3 - 4) / 7) and wrong.correct == 0.0
    assert wrong.info["criteria_met"] == [True, False, False, True]
    partial = reward("12 is even. It has 2 digits.", row(rubric))
    assert partial.score == pytest.approx(5 / 7) and partial.correct == 0.0  # not perfect: factorisation missing


def test_clipping_is_an_option():
    rubric, _ = rubric_and_gold(12)
    clipped = RubricReward(RubricConfig(clip=True))("12 is prime.", row(rubric))
    assert clipped.score == 0.0 and clipped.info["raw_score"] == pytest.approx(-4 / 7)
    assert REWARDS.get("rubric_clipped").cfg.clip and not REWARDS.get("rubric").cfg.clip
    assert REWARDS.get("rubric_judge").cfg.grader == "judge"


def test_zero_point_items_are_ignored_and_missing_checks_are_named():
    items = [{"criterion": "says even", "points": 2, "check": {"type": "contains", "value": "even"}},
             {"criterion": "is polite", "points": 0}]
    assert RubricReward(RubricConfig())("it is even", row(items)).score == 1.0
    no_check = [{"criterion": "is kind", "points": 1}]
    with pytest.raises(ValueError, match=r"row t.jsonl:5: rubric item 0 \('is kind'\) has no `check` spec"):
        RubricReward(RubricConfig())("x", row(no_check))
    with pytest.raises(ValueError, match="no rubric items with non-zero points"):
        RubricReward(RubricConfig())("x", row([{"criterion": "c", "points": 0}]))
    with pytest.raises(ValueError, match="rubric grader must be one of"):
        RubricConfig(grader="llm")


@pytest.mark.parametrize("reply, met", [
    ('{"explanation": "ok", "criteria_met": true}', True),
    ('```json\n{"explanation": "no", "criteria_met": false}\n```', False),
    ('Here it is: {"explanation": "x", "criteria_met": true} done', True),
])
def test_parse_verdict(reply, met):
    assert parse_verdict(reply) is met


@pytest.mark.parametrize("reply", ['{"criteria_met": "yes"}', "no json here", '{"criteria_met": tru}', "[true]"])
def test_unusable_verdicts_raise(reply):
    with pytest.raises(ValueError):
        parse_verdict(reply)


def test_prompt_pieces_follow_healthbench():
    assert rubric_line({"criterion": "claims that 12 is prime", "points": -4}) == "[-4] claims that 12 is prime"
    assert rubric_line({"criterion": "c", "points": 2.5}) == "[2.5] c"
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert render_conversation(messages, "A") == "system: S\n\nuser: Q\n\nassistant: A"
    template = load_template("judge/rubric_grader.txt")
    assert "<<conversation>>" in template and "<<rubric_item>>" in template and "criteria_met" in template


def test_template_errors_name_the_file(tmp_path):
    bad = tmp_path / "t.txt"
    bad.write_text("only <<conversation>>")
    with pytest.raises(ValueError, match=r"lacks the placeholders \['<<rubric_item>>'\]"):
        load_template(str(bad))
    with pytest.raises(ValueError, match="cannot read the judge template"):
        load_template(str(tmp_path / "absent.txt"))


def test_judge_metrics_aggregate_by_hand():
    infos = [
        {"grader": "judge", "judge_calls": 3.0, "judge_cache_hits": 1.0, "judge_retries": 1.0,
         "judge_latency_s": 0.6, "judge_latency_max_s": 0.3},
        {"grader": "judge", "judge_calls": 1.0, "judge_cache_hits": 3.0, "judge_retries": 0.0,
         "judge_latency_s": 0.2, "judge_latency_max_s": 0.2},
        {"fallback": "error", "error": "JudgeUnavailable: judge endpoint ... unreachable"},
        {"fallback": "error", "error": "ValueError: something else"},
    ]
    assert judge_metrics(infos) == pytest.approx({
        "judge/num_requests": 4.0, "judge/num_cache_hits": 4.0, "judge/num_retries": 1.0, "judge/num_failures": 1.0,
        "judge/latency_mean_s": 0.8 / 4, "judge/latency_max_s": 0.3})
    assert judge_metrics([{"grader": "rule"}]) == {}


def test_scores_in_a_reward_worker():
    rubric, gold = rubric_and_gold(7)  # prime: +3 odd, +2 "1 digit", +2 "7 is prime", -4 "7 is not prime"
    with RewardManager(RewardConfig(sources={"rubric_qa": "rubric"}, num_workers=1)) as manager:
        results = manager.score([gold, "7 is odd. 7 is not prime."], [row(rubric, 7)] * 2)
    assert [r.score for r in results] == pytest.approx([1.0, (3 - 4) / 7])
    assert [r.correct for r in results] == [1.0, 0.0]
