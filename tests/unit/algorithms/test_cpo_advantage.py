"""CPO advantage: difficulty on crafted groups, outcome tests under 0/1 and +-1 rewards, the estimator
end to end on hand-worked numbers, rows without a hint, no compounding, config errors."""

import logging
import math

import pytest
import torch

from aligner_ext.algorithms.advantages import GroupAdvantage
from aligner_ext.algorithms.cpo import CPOAdvantage, CPOConfig, difficulty, difficulty_metrics, outcomes
from aligner_ext.batch import ExperienceBatch
from aligner_ext.config import load_config

NAN = float("nan")


def scored(rewards, correct, group_ids=None):
    size = len(rewards)
    return ExperienceBatch(
        prompt_ids=torch.zeros(size, 1, dtype=torch.long), prompt_mask=torch.ones(size, 1, dtype=torch.bool),
        response_ids=torch.zeros(size, 1, dtype=torch.long), response_valid=torch.ones(size, 1, dtype=torch.bool),
        response_mask=torch.ones(size, 1, dtype=torch.bool),
        group_ids=torch.tensor(group_ids if group_ids is not None else list(range(size))), samples=[],
        rewards=torch.tensor(rewards, dtype=torch.float32), correct=torch.tensor(correct, dtype=torch.float32))


def test_three_level_difficulty_on_interleaved_groups_of_different_sizes():
    ids = torch.tensor([7, 3, 7, 3, 5, 5, 5, 9])
    correct = torch.tensor([1, 0, 1, 0, 1, 0, 1, 1], dtype=torch.bool)
    levels = difficulty(correct, correct.float(), ids, CPOConfig())
    assert levels.tolist() == [1, -1, 1, -1, 0, 0, 0, 1]  # g7 all right, g3 all wrong, g5 mixed, g9 alone
    assert levels.dtype == torch.int64
    assert difficulty_metrics(levels, ids, "three") == {
        "cpo/difficulty_all_wrong": 0.25, "cpo/difficulty_mixed": 0.25, "cpo/difficulty_all_correct": 0.5}


def test_plus_minus_one_rewards_without_correctness_give_the_same_outcomes_as_zero_one():
    zero_one = scored([1, 0, 0, 1], [1, 0, 0, 1])
    plus_minus = scored([1, -1, -1, 1], [NAN] * 4)
    correct_a, from_reward_a = outcomes(zero_one)
    correct_b, from_reward_b = outcomes(plus_minus)
    assert correct_a.tolist() == correct_b.tolist() == [True, False, False, True]
    assert (from_reward_a, from_reward_b) == (0, 4)
    ids = torch.tensor([0, 0, 1, 1])
    assert difficulty(correct_a, zero_one.rewards, ids, CPOConfig()).tolist() == [0, 0, 0, 0]
    assert difficulty(correct_b, plus_minus.rewards, torch.tensor([0, 1, 1, 2]), CPOConfig()).tolist() == [1, -1, -1, 1]


def test_outcome_prefers_the_reported_correctness_over_the_reward():
    correct, from_reward = outcomes(scored([0.2, 0.9, 0.5, 0.0], [0, 1, NAN, NAN]))
    assert correct.tolist() == [False, True, True, False] and from_reward == 2


def test_five_level_difficulty_reproduces_the_seed_buckets_for_n_8():
    counts = [0, 1, 2, 3, 5, 6, 7, 8]  # correct samples out of 8 per group
    ids = torch.arange(len(counts)).repeat_interleave(8)
    correct = torch.tensor([i < k for k in counts for i in range(8)])
    levels = difficulty(correct, correct.float(), ids, CPOConfig(difficulty="five"))
    assert levels[::8].tolist() == [-2, -1, -1, 0, 0, 1, 1, 2]


def test_variance_difficulty_uses_the_unbiased_reward_variance():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, -1.0, 1.0, 0.0, 0.5])
    ids = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3, 3])
    # variances: 0 (< 0.1: +1), 0.5 (not > 0.5: 0), 2 (> 0.5: -1), 0.125 (0)
    levels = difficulty(rewards > 0, rewards, ids, CPOConfig(difficulty="variance"))
    assert levels.tolist() == [1, 1, 1, 0, 0, -1, -1, 0, 0]


def hinted_batch():
    """Group 0 = rows 0, 1, 3 (rewards 1, 0, 0), group 1 = row 2 (reward 0); row 3 has no hint; row 2 is padded."""
    batch = scored([1, 0, 0, 0], [1, 0, 0, 0], group_ids=[0, 0, 1, 0])
    batch.response_ids = torch.zeros(4, 3, dtype=torch.long)
    batch.response_valid = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    batch.response_mask = batch.response_valid.clone()
    plain = torch.tensor([[0.5, 0.5, 0.5], [0.25, 0.4, 1.0], [0.25, 0.4, 1.0], [0.3, 0.3, 0.3]]).log()
    hint = torch.tensor([[0.5, 0.5, 0.5], [0.5, 0.2, 1.0], [0.5, 0.2, 1.0], [0.9, 0.9, 0.9]]).log()
    batch.old_logprobs, batch.hint_logprobs = plain, hint
    batch.has_hint = torch.tensor([True, True, True, False])
    batch.entropy = torch.tensor([[0.4, 1.0, 0.2], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    return batch  # difficulty, found by the estimator: group 0 mixed (0), group 1 all wrong (-1)


def estimator(wrap_method="mi2", **cfg):
    cfg = CPOConfig(pos_alpha=0.1, neg_alpha=0.5, uncertainty="vocab", **cfg)
    return CPOAdvantage(cfg, wrap_method, GroupAdvantage(GroupAdvantage.Config()), vocab_size=math.e ** 2)


def test_estimator_on_hand_worked_numbers():
    advantages = estimator()(hinted_batch())
    a_right, a_wrong = 2 / math.sqrt(3), -1 / math.sqrt(3)  # group [1, 0, 0]: mean 1/3, std sqrt(1/3)
    mi = [0.5 * math.log(2), -0.2 * math.log(2), 0.0]  # exp(lp_hint)·(lp_hint - lp)
    expected = torch.tensor([
        [a_right + 0.1 * 0.2, a_right + 0.1 * 0.5, a_right + 0.1 * 0.1],  # correct: + pos·U, U = H / log(e^2)
        [a_wrong + 0.5 * mi[0], a_wrong + 0.5 * mi[1], a_wrong + 0.5 * mi[2]],  # wrong: + neg·MI
        [0.5 * mi[0], 0.5 * mi[1], 0.0],  # group of one: GRPO 0, + neg·MI; the padded token stays 0
        [a_wrong, a_wrong, a_wrong],  # no hint: GRPO's advantage
    ], dtype=torch.float32)
    torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-6)


def test_metrics_report_the_advantage_change_over_shaped_tokens():
    cpo = estimator()
    cpo(hinted_batch())
    changes = [0.02, 0.05, 0.01] + [0.5 * 0.5 * math.log(2), -0.5 * 0.2 * math.log(2), 0.0] * 2
    changes = changes[:8]  # row 2's third token is padding
    metrics = cpo.metrics()
    assert metrics["cpo/advantage_change_mean"] == pytest.approx(sum(changes) / 8, abs=1e-6)
    assert metrics["cpo/advantage_change_abs_mean"] == pytest.approx(sum(abs(c) for c in changes) / 8, abs=1e-6)
    assert metrics["cpo/shaped_token_fraction"] == pytest.approx(7 / 8)  # MI = 0 on row 1, token 3


def test_shaping_does_not_compound_and_ignores_stored_advantages():
    cpo = estimator("negonly_mi3")
    batch = hinted_batch()
    first = cpo(batch)
    batch.advantages = first
    assert torch.equal(cpo(batch), first)  # a second pass starts again from the GRPO advantage
    batch.advantages = torch.full_like(first, 123.0)
    assert torch.equal(cpo(batch), first)


def test_bad_wrap_method_lists_the_known_ones():
    with pytest.raises(KeyError, match=r"unknown cpo advantage wrapper 'mi4'; known: .*negonly_mi3"):
        estimator("mi4")


def test_mi_alpha_is_accepted_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        estimator(mi_alpha=0.1)
    assert "cpo.mi_alpha=0.1 is accepted" in caplog.text


@pytest.mark.parametrize("override, message", [
    ("cpo.cpo_lambda=1.0", r"^cpo\.cpo_lambda=1: must be a finite number > 1$"),
    ("cpo.difficulty=seven", r"^cpo\.difficulty='seven': must be one of three, five, variance$"),
    ("cpo.uncertainty=rank", r"^cpo\.uncertainty='rank': must be one of minmax, vocab$"),
    ("cpo.variance_low=0.6", r"cpo\.variance_low \(0\.6\) must be <= cpo\.variance_high"),
])
def test_bad_cpo_config_names_the_key(override, message):
    with pytest.raises(ValueError, match=message):
        load_config("base", ["algorithm.adv_estimator=cpo", override])


def test_seed_keys_compose_from_the_command_line():
    cfg = load_config("base", ["algorithm.adv_estimator=cpo", "algorithm.gold_as_hint=false",
                               "algorithm.wrap_method=mi_qwen3", "cpo.cpo_lambda=2", "cpo.pos_alpha=0",
                               "cpo.neg_alpha=0.5", "cpo.mi_alpha=0.1"])
    assert (cfg.cpo.gold_as_hint, cfg.cpo.wrap_method) == (False, "mi_qwen3")
    assert (cfg.cpo.cpo_lambda, cfg.cpo.pos_alpha, cfg.cpo.neg_alpha, cfg.cpo.mi_alpha) == (2.0, 0.0, 0.5, 0.1)
    variant = load_config("base", ["+variant=cpo"])
    assert (variant.algorithm.adv_estimator, variant.cpo.wrap_method) == ("cpo", "negonly_mi3")
    assert "hint_logprobs" in variant.algorithm.experience_wrappers
