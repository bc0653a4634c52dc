"""The divergence guard: an update that moves the weights' norm by more than
policy.optim.max_update_ratio of it is counted as diverged in the step's metrics (the loop stops on
it, tests/e2e/test_diverging_run.py), no further update of the step runs on the broken weights, and
a sane learning rate stays far below the bound."""

import math

import pytest
import torch

from aligner_ext.config import load_config
from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.models.base import NonFiniteGuard, weights_norm
from aligner_ext.models.settings import OptimConfig
from test_hf_policy import make_policy
from test_nonfinite_updates import prepared


def test_the_guard_judges_the_change_of_the_weights_norm():
    guard = NonFiniteGuard(limit=3, max_update_ratio=0.1)
    assert guard.diverged(10.0, 10.5) == (pytest.approx(0.05), False)
    assert guard.diverged(10.0, 8.5) == (pytest.approx(0.15), True)  # shrinking counts as well
    assert guard.diverged(10.0, math.inf) == (math.inf, True)  # a norm whose square overflowed
    assert NonFiniteGuard(limit=3, max_update_ratio=0.0).diverged(10.0, math.inf)[1] is False  # 0 turns it off
    assert weights_norm([torch.full((2,), 3.0), torch.full((1,), 4.0)]) == pytest.approx(math.sqrt(18 + 16))
    for bad in (-1.0, math.nan):  # NaN would compare false and switch the guard off unnoticed
        with pytest.raises(ValueError, match=r"^policy.optim.max_update_ratio=(-1|nan): must be a finite number >= 0$"):
            load_config("base", [f"policy.optim.max_update_ratio={bad}"])


def test_an_update_at_lr_1e30_is_counted_as_diverged_and_ends_the_steps_updates(tiny_model, tiny_tokenizer):
    policy = make_policy(tiny_model, mini_batch_size=3, optim=OptimConfig(lr=1e30))  # two updates per step
    metrics = policy.train(prepared(policy, tiny_tokenizer), ClippedPGLoss(ClippedPGLoss.Config()), temperature=1.0)
    assert all(torch.isfinite(p).all() for p in policy.model.parameters())  # finite: the non-finite guard passes it
    assert metrics["actor/diverged_updates"] == 1 and metrics["actor/update_ratio_max"] > 1e20
    assert metrics["actor/num_updates"] == 1  # the second update did not run on the broken weights


def test_a_sane_learning_rate_stays_far_below_the_bound(tiny_model, tiny_tokenizer):
    policy = make_policy(tiny_model, mini_batch_size=3, optim=OptimConfig(lr=1e-3))
    metrics = policy.train(prepared(policy, tiny_tokenizer), ClippedPGLoss(ClippedPGLoss.Config()), temperature=1.0)
    assert metrics["actor/diverged_updates"] == 0 and metrics["actor/num_updates"] == 2
    assert 0 < metrics["actor/update_ratio_max"] < OptimConfig().max_update_ratio / 10
