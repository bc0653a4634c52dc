"""The decoupled clipped objective of asynchronous training (clipped_pg with token_tis, the proximal policy
in old_logprobs, the behaviour policy in generation_logprobs) and the stale-token mask, against a float64
reference written from the formula (losses/off_policy.py)."""

import math

import pytest
import torch

from aligner_ext.losses.base import GlobalCounts
from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.losses.settings import LossConfig

MASK = [[True, True, True], [True, True, False]]
CURRENT = [[-1.0, -0.5, -2.0], [-0.7, -1.5, 0.0]]  # log pi
PROXIMAL = [[-1.1, -0.9, -1.9], [-0.7, -1.2, 0.0]]  # log pi_prox: ratios 1.105, 1.492, 0.905, 1.0, 0.741
BEHAVIOUR = [[-1.3, -0.6, -3.0], [-0.9, -1.0, 0.0]]  # log pi_behav: prox/behav 1.221, 0.741, 3.004, 1.221, 0.819
ADVANTAGES = [[1.0, 1.0, -1.0], [-1.0, -1.0, 0.0]]
STALENESS = [[0, 1, 2], [3, 0, 0]]
EPSILON, CAP = 0.2, 2.0


def reference_loss(max_staleness):
    """sum over the 5 tokens of -min(r A, clip(r) A) * min(prox / behav, C) * 1[staleness <= k], / 5."""
    total = 0.0
    for row in range(2):
        for col in range(3):
            if not MASK[row][col]:
                continue
            ratio = math.exp(CURRENT[row][col] - PROXIMAL[row][col])
            adv = ADVANTAGES[row][col]
            surrogate = -min(ratio * adv, min(max(ratio, 1 - EPSILON), 1 + EPSILON) * adv)
            weight = min(math.exp(PROXIMAL[row][col] - BEHAVIOUR[row][col]), CAP)
            fresh = max_staleness is None or STALENESS[row][col] <= max_staleness
            total += surrogate * weight * fresh
    return total / 5


def loss_and_batch(make_batch, max_staleness):
    loss = ClippedPGLoss(LossConfig(epsilon=EPSILON, epsilon_high=EPSILON, off_policy_correction="token_tis",
                                    importance_sampling_cap=CAP, max_token_staleness=max_staleness))
    batch = make_batch(MASK, torch.tensor(ADVANTAGES, dtype=torch.float64), torch.tensor(PROXIMAL, dtype=torch.float64))
    batch.generation_logprobs = torch.tensor(BEHAVIOUR, dtype=torch.float64)
    batch.generation_versions = torch.tensor([[5, 4, 3], [2, 5, 0]])
    batch.staleness = torch.tensor(STALENESS)
    return loss, batch


@pytest.mark.parametrize("max_staleness", [None, 1, 0])
def test_decoupled_objective_matches_the_reference(make_batch, max_staleness):
    loss, batch = loss_and_batch(make_batch, max_staleness)
    logprobs = torch.tensor(CURRENT, dtype=torch.float64, requires_grad=True)
    value, metrics = loss(logprobs, batch, GlobalCounts(tokens=5, sequences=2))
    assert float(value.detach()) == pytest.approx(reference_loss(max_staleness), rel=1e-12)
    stale = {None: 0, 1: 2, 0: 3}[max_staleness]  # tokens with staleness 2 and 3, then the one with 1 too
    assert metrics.get("actor/stale_masked_frac", 0.0) == pytest.approx(stale / 5)


def test_the_gradient_flows_only_through_the_current_policy(make_batch):
    """d loss / d log pi = -r A w / 5 where the clip is inactive, 0 where it clips or the token is stale:
    the behaviour and proximal log-probs are constants."""
    loss, batch = loss_and_batch(make_batch, 1)
    logprobs = torch.tensor(CURRENT, dtype=torch.float64, requires_grad=True)
    value, _ = loss(logprobs, batch, GlobalCounts(tokens=5, sequences=2))
    value.backward()
    expected = [[0.0] * 3, [0.0] * 3]
    for row, col in [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]:
        ratio = math.exp(CURRENT[row][col] - PROXIMAL[row][col])
        adv = ADVANTAGES[row][col]
        clipped = (adv > 0 and ratio > 1 + EPSILON) or (adv < 0 and ratio < 1 - EPSILON)
        if clipped or STALENESS[row][col] > 1:
            continue
        weight = min(math.exp(PROXIMAL[row][col] - BEHAVIOUR[row][col]), CAP)
        expected[row][col] = -ratio * adv * weight / 5
    # token (0, 1): ratio 1.49 > 1.2 with A > 0 is clipped; (0, 2) and (1, 0) are stale
    torch.testing.assert_close(logprobs.grad, torch.tensor(expected, dtype=torch.float64))


def test_the_mask_reads_versions_the_contract_checks():
    loss = ClippedPGLoss(LossConfig(max_token_staleness=2))
    assert {"generation_versions", "staleness"} <= set(loss.reads)
    assert "staleness" not in ClippedPGLoss(LossConfig()).reads
