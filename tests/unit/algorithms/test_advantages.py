"""Group-normalised advantages, worked out by hand on small groups."""

import math

import pytest
import torch

from aligner_ext.algorithms.advantages import ADVANTAGES, GroupAdvantage, group_baseline_normalize
from aligner_ext.config import RunConfig
from aligner_ext.context import BuildContext
from aligner_ext.groups import group_stats, groups_all_agree, zero_std_group_fraction

# Three groups spread over the batch: id 7 -> rewards 1,0,0,1; id 2 -> 1,1,1; id 5 -> 0.35,0.35.
REWARDS = torch.tensor([1.0, 1.0, 0.35, 0.0, 1.0, 0.0, 1.0, 0.35, 1.0])
GROUPS = torch.tensor([7, 2, 5, 7, 2, 7, 2, 5, 7])


def test_non_contiguous_groups_with_bessel_std():
    adv = group_baseline_normalize(REWARDS, GROUPS, use_std=True, std_floor=1e-4)
    # group 7: mean 1/2, unbiased std sqrt(4 * 1/4 / 3) = 1/sqrt(3), so A = +-(1/2) * sqrt(3)
    half_sqrt3 = math.sqrt(3) / 2
    expected = [half_sqrt3, 0.0, 0.0, -half_sqrt3, 0.0, -half_sqrt3, 0.0, 0.0, half_sqrt3]
    assert adv.tolist() == pytest.approx(expected, abs=1e-12)
    # all-equal groups are exactly zero, not a float residue
    assert all(adv[i].item() == 0.0 for i in (1, 2, 4, 6, 7))


def test_without_std_is_mean_centring_only():
    adv = group_baseline_normalize(REWARDS, GROUPS, use_std=False, std_floor=1e-4)
    assert adv.tolist() == pytest.approx([0.5, 0.0, 0.0, -0.5, 0.0, -0.5, 0.0, 0.0, 0.5], abs=1e-12)


def test_identical_rewards_give_exact_zero_where_float32_leaves_a_residue():
    rewards = torch.full((7,), 0.35)
    naive = rewards - rewards.mean()  # float32 sum of seven 0.35 is not exact
    assert naive.abs().max().item() > 0
    adv = group_baseline_normalize(rewards, torch.zeros(7, dtype=torch.long), use_std=True, std_floor=1e-9)
    assert adv.abs().max().item() == 0.0


def test_group_of_one_gets_zero():
    adv = group_baseline_normalize(torch.tensor([0.7, 1.0, 0.0]), torch.tensor([3, 4, 4]), use_std=True, std_floor=1e-4)
    # group 4: mean 1/2, std sqrt((1/4 + 1/4) / 1) = 1/sqrt(2) -> A = +-1/sqrt(2)
    assert adv.tolist() == pytest.approx([0.0, 1 / math.sqrt(2), -1 / math.sqrt(2)], abs=1e-12)


def test_std_floor_bounds_near_ties():
    rewards = torch.tensor([1.0, 1.0 + 1e-9, 1.0 - 1e-9], dtype=torch.float64)
    ids = torch.zeros(3, dtype=torch.long)
    # std = sqrt((1e-18 + 1e-18) / 2) = 1e-9 < floor 1e-4, so A = centred / 1e-4 = (0, 1e-5, -1e-5)
    adv = group_baseline_normalize(rewards, ids, use_std=True, std_floor=1e-4)
    assert adv.tolist() == pytest.approx([0.0, 1e-5, -1e-5], rel=1e-5, abs=1e-12)
    # with a floor below the std, the near-tie is blown up to unit scale
    unfloored = group_baseline_normalize(rewards, ids, use_std=True, std_floor=1e-12)
    assert unfloored.tolist() == pytest.approx([0.0, 1.0, -1.0], rel=1e-5, abs=1e-6)


def test_group_stats_and_agreement():
    stats = group_stats(REWARDS, GROUPS)
    assert stats.ids.tolist() == [2, 5, 7]
    assert stats.size.tolist() == [3, 2, 4]
    assert stats.mean.tolist() == pytest.approx([1.0, 0.35, 0.5], abs=1e-7)
    assert stats.spread.tolist() == pytest.approx([0.0, 0.0, 1.0])
    assert stats.per_sample(stats.size).tolist() == [4, 3, 2, 4, 3, 4, 3, 2, 4]
    assert groups_all_agree(REWARDS, GROUPS, eps=0.0) == {2: True, 5: True, 7: False}
    assert zero_std_group_fraction(REWARDS, GROUPS, eps=0.0) == pytest.approx(2 / 3)


def test_agreement_tolerance():
    scores = torch.tensor([0.5, 0.5 + 1e-8, 0.0, 1.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 1, 1])
    assert groups_all_agree(scores, ids, eps=1e-6) == {0: True, 1: False}
    assert groups_all_agree(scores, ids, eps=0.0) == {0: False, 1: False}


def test_grpo_broadcasts_over_masked_response_tokens(make_batch):
    batch = make_batch([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 1, 1]], group_ids=[0, 0, 1, 1],
                       rewards=[1.0, 0.0, 0.5, 0.5])
    adv = GroupAdvantage(GroupAdvantage.Config())(batch)
    a = 1 / math.sqrt(2)  # group 0: mean 1/2, std 1/sqrt(2), A = +-(1/2) * sqrt(2)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([[a, a, 0.0], [-a, -a, -a], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]))

    dr = GroupAdvantage(GroupAdvantage.Config(use_std=False))(batch)
    torch.testing.assert_close(dr, torch.tensor([[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5], [0.0] * 3, [0.0] * 3]))
    assert ADVANTAGES.get("grpo") is GroupAdvantage


def test_bad_input_is_named(make_batch):
    advantage = GroupAdvantage(GroupAdvantage.Config())  # unset rewards: the build's contract check (test_contracts.py)
    with pytest.raises(ValueError, match="test:1"):
        advantage(make_batch([[1], [1]], group_ids=[0, 0], rewards=[0.0, float("nan")]))
    with pytest.raises(ValueError, match="must both be"):
        group_stats(torch.zeros(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="std_floor"):
        GroupAdvantage(GroupAdvantage.Config(std_floor=0.0))


def test_a_group_of_one_is_a_config_error():
    cfg = RunConfig()
    cfg.rollout.n = 1
    with pytest.raises(ValueError, match="rollout.n=1"):
        GroupAdvantage.from_context(BuildContext(cfg=cfg, tokenizer=None, policy=None, engine=None, rewards=None))
    cfg.rollout.n = 2
    assert isinstance(GroupAdvantage.from_context(BuildContext(cfg=cfg, tokenizer=None, policy=None, engine=None,
                                                               rewards=None)), GroupAdvantage)
