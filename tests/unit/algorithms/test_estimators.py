"""RLOO, REINFORCE++ and REINFORCE++-baseline against float64 references written from the papers' formulas,
on hand-worked groups: spread and unequal groups, all-equal groups, groups of one, padded and empty rows."""

import math
import random

import pytest
import torch

from aligner_ext.algorithms.advantages import ADVANTAGES, GroupAdvantage
from aligner_ext.algorithms.estimators import (
    LeaveOneOutAdvantage,
    ReinforcePlusPlusAdvantage,
    ReinforcePlusPlusBaselineAdvantage,
)
from aligner_ext.config import load_config
from aligner_ext.context import BuildContext

CONFIG = GroupAdvantage.Config()


def rloo_reference(rewards, groups):
    """A_i = r_i - mean of the other rewards of i's group (Kool et al. 2019), 0 alone in its group."""
    out = []
    for i, (r, g) in enumerate(zip(rewards, groups)):
        others = [rewards[j] for j in range(len(rewards)) if groups[j] == g and j != i]
        out.append(r - sum(others) / len(others) if others else 0.0)
    return out


def batch_reference(values, lengths, use_std=True, floor=1e-4):
    """(A_i) = (v_i - mu) / max(sigma, floor), mu and sigma over every token (row i repeated lengths[i] times)."""
    tokens = [v for v, n in zip(values, lengths) for _ in range(n)]
    if not tokens:
        return [0.0] * len(values)
    mu = sum(tokens) / len(tokens)
    sigma = math.sqrt(sum((t - mu) ** 2 for t in tokens) / len(tokens))
    if sigma == 0:
        return [0.0] * len(values)
    return [(v - mu) / max(sigma, floor) if use_std else v - mu for v in values]


def group_mean_reference(rewards, groups):
    means = {g: sum(r for r, h in zip(rewards, groups) if h == g) / groups.count(g) for g in set(groups)}
    return [r - means[g] for r, g in zip(rewards, groups)]


def ragged(make_batch, lengths, rewards, groups, width=4):
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    return make_batch(mask, group_ids=groups, rewards=rewards)


def test_rloo_hand_worked_spread_groups(make_batch):
    # group 7 (rows 0, 3, 5, 8): 1, 0, 0, 1 -> 1 - 1/3 = 2/3 and 0 - 2/3; group 2: all 1; group 5: all 0.35
    rewards = [1.0, 1.0, 0.35, 0.0, 1.0, 0.0, 1.0, 0.35, 1.0]
    groups = [7, 2, 5, 7, 2, 7, 2, 5, 7]
    adv = LeaveOneOutAdvantage(CONFIG)(ragged(make_batch, [1] * 9, rewards, groups))[:, 0]
    assert adv.tolist() == pytest.approx([2 / 3, 0, 0, -2 / 3, 0, -2 / 3, 0, 0, 2 / 3], abs=1e-7)
    assert all(adv[i].item() == 0.0 for i in (1, 2, 4, 6, 7))  # all-equal groups: exactly 0, no float residue


def test_rloo_unequal_groups_and_a_group_of_one(make_batch):
    # group 0: 1, 0, 0.5 -> 1 - 0.25, 0 - 0.75, 0.5 - 0.5; group 1 holds one sample -> 0
    adv = LeaveOneOutAdvantage(CONFIG)(ragged(make_batch, [2, 3, 1, 4], [1.0, 0.0, 0.5, 0.9], [0, 0, 0, 1]))
    assert adv[:, 0].tolist() == pytest.approx([0.75, -0.75, 0.0, 0.0])


@pytest.mark.parametrize("seed", range(5))
def test_rloo_matches_the_reference_on_random_groups(make_batch, seed):
    rng = random.Random(seed)
    groups = [rng.choice([3, 1, 4, 8]) for _ in range(13)]
    rewards = [rng.choice([0.0, 1.0, rng.random()]) for _ in groups]
    lengths = [rng.randint(0, 4) for _ in groups]
    batch = ragged(make_batch, lengths, rewards, groups)
    adv = LeaveOneOutAdvantage(CONFIG)(batch)
    expected = torch.tensor(rloo_reference(batch.rewards.tolist(), groups), dtype=torch.float64)  # the float32 rewards
    torch.testing.assert_close(adv, (expected[:, None] * batch.response_mask).float())


def test_reinforce_pp_is_token_weighted_over_the_batch(make_batch):
    # tokens carry 1, 1, 0, 0: mu 1/2, sigma 1/2 -> A = 1, -1, -1; the masked-out row 3 takes no part
    batch = ragged(make_batch, [2, 1, 1, 0], [1.0, 0.0, 0.0, 7.0], [0, 1, 2, 3])
    estimator = ReinforcePlusPlusAdvantage(CONFIG)
    adv = estimator(batch)
    assert adv[:, 0].tolist() == pytest.approx([1.0, -1.0, -1.0, 0.0])
    assert adv[0, 1].item() == pytest.approx(1.0) and adv[1, 1].item() == 0.0  # padding stays 0
    assert estimator.metrics() == pytest.approx({"advantage/batch_mean": 0.5, "advantage/batch_std": 0.5})
    centred = ReinforcePlusPlusAdvantage(GroupAdvantage.Config(use_std=False))(batch)
    assert centred[:, 0].tolist() == pytest.approx([0.5, -0.5, -0.5, 0.0])


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("use_std", [True, False])
def test_reinforce_pp_and_baseline_match_the_reference(make_batch, seed, use_std):
    rng = random.Random(seed)
    groups = [rng.choice([0, 1, 2]) for _ in range(11)]
    lengths = [rng.randint(0, 4) for _ in groups]
    batch = ragged(make_batch, lengths, [rng.choice([0.0, 1.0, rng.random()]) for _ in groups], groups)
    rewards = batch.rewards.tolist()  # the float32 values the estimators see
    cfg = GroupAdvantage.Config(use_std=use_std)
    for estimator, values in ((ReinforcePlusPlusAdvantage(cfg), rewards),
                              (ReinforcePlusPlusBaselineAdvantage(cfg), group_mean_reference(rewards, groups))):
        expected = torch.tensor(batch_reference(values, lengths, use_std), dtype=torch.float64)
        torch.testing.assert_close(estimator(batch), (expected[:, None] * batch.response_mask).float())


def test_reinforce_pp_baseline_hand_worked(make_batch):
    # group 0: 1, 0 (lengths 1, 3) centred +-1/2; group 1: 1, 1 (lengths 2, 2) centred 0.
    # tokens: 0.5 x1, -0.5 x3, 0 x4 -> mu = -1/8, var = (0.625^2 + 3 * 0.375^2 + 4 * 0.125^2) / 8 = 7/64
    batch = ragged(make_batch, [1, 3, 2, 2], [1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1])
    adv = ReinforcePlusPlusBaselineAdvantage(CONFIG)(batch)[:, 0]
    sigma = math.sqrt(7 / 64)
    assert adv.tolist() == pytest.approx([0.625 / sigma, -0.375 / sigma, 0.125 / sigma, 0.125 / sigma], rel=1e-6)
    # the paper's batch step is affine on every token, so the all-equal group ends at -mu / sigma, not 0


def test_all_equal_rewards_give_exact_zero_everywhere(make_batch):
    batch = ragged(make_batch, [4, 1, 3, 2, 4, 2, 1], [0.35] * 7, [0, 0, 1, 1, 1, 2, 2])
    for cls in (GroupAdvantage, LeaveOneOutAdvantage, ReinforcePlusPlusAdvantage, ReinforcePlusPlusBaselineAdvantage):
        assert cls(CONFIG)(batch).abs().max().item() == 0.0, cls.__name__


@pytest.mark.parametrize("cls", [GroupAdvantage, LeaveOneOutAdvantage, ReinforcePlusPlusAdvantage,
                                 ReinforcePlusPlusBaselineAdvantage])
def test_empty_and_fully_masked_batches(make_batch, cls):
    empty = make_batch(torch.zeros(0, 3), group_ids=torch.zeros(0, dtype=torch.long), rewards=[])
    assert cls(CONFIG)(empty).shape == (0, 3)
    masked = ragged(make_batch, [0, 0], [1.0, 0.0], [0, 0])
    assert cls(CONFIG)(masked).abs().max().item() == 0.0


def test_non_finite_rewards_are_named(make_batch):
    batch = ragged(make_batch, [1, 1], [1.0, math.nan], [0, 0])
    with pytest.raises(ValueError, match=r"non-finite rewards for rows \['test:1'\]"):
        ReinforcePlusPlusAdvantage(CONFIG)(batch)


def test_registered_names_group_sizes_and_settings():
    assert ADVANTAGES.get("reinforce++") is ReinforcePlusPlusAdvantage
    assert ADVANTAGES.get("reinforce++_baseline") is ReinforcePlusPlusBaselineAdvantage
    ctx = BuildContext(cfg=load_config("base", ["algorithm.adv_estimator=reinforce_plus_plus", "rollout.n=1"]),
                       tokenizer=None, policy=None, engine=None, rewards=None)
    assert isinstance(ADVANTAGES.get("reinforce_plus_plus").from_context(ctx), ReinforcePlusPlusAdvantage)
    for name in ("rloo", "reinforce_plus_plus_baseline"):  # a group of one has no baseline
        with pytest.raises(ValueError, match=f"rollout.n=1: algorithm.adv_estimator={name}"):
            load_config("base", [f"algorithm.adv_estimator={name}", "rollout.n=1"])
    with pytest.raises(ValueError, match="advantage.use_std=false: rloo divides by no std"):
        LeaveOneOutAdvantage(GroupAdvantage.Config(use_std=False))
