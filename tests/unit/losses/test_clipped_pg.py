"""Clipped policy-gradient loss on hand-worked ratios: every branch of the min and the clip fires."""

import math

import pytest
import torch

from aligner_ext.losses.base import LOSSES, GlobalCounts
from aligner_ext.losses.clipped_pg import ClippedPGLoss

OLD = -1.0  # every old log-prob; current log-probs are OLD + log(ratio)


def logprobs_for(ratios):
    return (OLD + torch.log(torch.tensor(ratios, dtype=torch.float64))).requires_grad_()


def test_ppo_clipping_every_branch(make_batch):
    ratios = [[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]]
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    batch = make_batch(torch.ones(2, 3), adv, torch.full((2, 3), OLD, dtype=torch.float64))
    logprobs = logprobs_for(ratios)
    loss_fn = ClippedPGLoss(ClippedPGLoss.Config(epsilon=0.2, epsilon_high=0.2))
    loss, metrics = loss_fn(logprobs, batch, GlobalCounts(tokens=6, sequences=2))

    # clip(r) = 0.8 / 1.0 / 1.2.  A = +1: -min(r, clip r) = -0.5, -1.0, -1.2 (high clip active)
    #                             A = -1: -min(-r, -clip r) = 0.8 (low clip active), 1.0, 1.5
    per_token = [-0.5, -1.0, -1.2, 0.8, 1.0, 1.5]
    assert loss.item() == pytest.approx(sum(per_token) / 6)
    assert metrics["loss/pg"] == pytest.approx(0.1)
    assert metrics["loss/total"] == pytest.approx(0.1) and metrics["loss/kl"] == 0.0
    assert metrics["actor/clip_frac_low"] == pytest.approx(1 / 6)
    assert metrics["actor/clip_frac_high"] == pytest.approx(1 / 6)
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0)
    # k3 of the policy against old: 1/r + log r - 1 for r = 0.5, 1, 1.5 (each twice)
    k3 = [1 / r + math.log(r) - 1 for r in (0.5, 1.0, 1.5)]
    assert metrics["actor/approx_kl_old"] == pytest.approx(2 * sum(k3) / 6)
    assert "actor/kl" not in metrics and "actor/entropy" not in metrics

    # d loss / d logprob = -A * r / 6 where the unclipped term is chosen, 0 where the clip is
    (grad,) = torch.autograd.grad(loss, logprobs)
    expected = torch.tensor([[-0.5, -1.0, 0.0], [0.0, 1.0, 1.5]], dtype=torch.float64) / 6
    torch.testing.assert_close(grad, expected)


def test_asymmetric_upper_clip(make_batch):
    old = torch.full((1, 2), OLD, dtype=torch.float64)
    batch = make_batch(torch.ones(1, 2), torch.ones(1, 2, dtype=torch.float64), old)
    counts = GlobalCounts(tokens=2, sequences=1)
    # ratios 1.25, 1.5 with A = 1: symmetric 0.2 clips both at 1.2; clip-higher 0.28 keeps 1.25, clips 1.5 at 1.28
    logprobs = logprobs_for([[1.25, 1.5]])
    symmetric, sym_metrics = ClippedPGLoss(ClippedPGLoss.Config())(logprobs, batch, counts)
    higher, high_metrics = ClippedPGLoss(ClippedPGLoss.Config(epsilon_high=0.28))(logprobs, batch, counts)
    assert symmetric.item() == pytest.approx(-(1.2 + 1.2) / 2)
    assert higher.item() == pytest.approx(-(1.25 + 1.28) / 2)
    assert sym_metrics["actor/clip_frac_high"] == pytest.approx(1.0)
    assert high_metrics["actor/clip_frac_high"] == pytest.approx(0.5)


def test_dual_clip_caps_negative_advantage_tokens_far_above_one(make_batch):
    # ratios 0.5, 2, 5 with A = -2 (row 0) and A = +2 (row 1); epsilon 0.2, clip_ratio_c 3
    ratios = [[0.5, 2.0, 5.0], [0.5, 2.0, 5.0]]
    adv = torch.tensor([[-2.0] * 3, [2.0] * 3], dtype=torch.float64)
    batch = make_batch(torch.ones(2, 3), adv, torch.full((2, 3), OLD, dtype=torch.float64))
    counts = GlobalCounts(tokens=6, sequences=2)
    logprobs = logprobs_for(ratios)
    loss, metrics = ClippedPGLoss(ClippedPGLoss.Config(clip_ratio_c=3.0))(logprobs, batch, counts)
    # A = -2: ordinary -min(rA, clip(r)A) = max(2r, 2 clip(r)) = 1.6, 4, 10; the dual cap -c A = 6 lowers 10 to 6
    # A = +2: -min(2r, 2 clip(r)) = -1, -2.4, -2.4 (untouched: the cap applies to A < 0 only)
    per_token = [1.6, 4.0, 6.0, -1.0, -2.4, -2.4]
    assert loss.item() == pytest.approx(sum(per_token) / 6)
    assert metrics["actor/clip_frac_dual"] == pytest.approx(1 / 6)
    # the capped token is a constant: no gradient; r = 2 with A = -2 keeps d/dlogprob = -A r / 6 = 4/6
    (grad,) = torch.autograd.grad(loss, logprobs)
    expected = torch.tensor([[0.0, 4.0, 0.0], [-1.0, 0.0, 0.0]], dtype=torch.float64) / 6
    torch.testing.assert_close(grad, expected)
    off, off_metrics = ClippedPGLoss(ClippedPGLoss.Config())(logprobs, batch, counts)
    assert off.item() == pytest.approx((1.6 + 4.0 + 10.0 - 1.0 - 2.4 - 2.4) / 6) and "actor/clip_frac_dual" not in off_metrics
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        ClippedPGLoss(ClippedPGLoss.Config(clip_ratio_c=0.9))


def test_first_iteration_is_minus_advantage_token_mean(make_batch):
    logprobs = torch.tensor([[-1.0, -2.0, -50.0], [-0.5, -3.0, -4.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[2.0, 2.0, 0.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    old = logprobs.detach().clone()
    old[0, 2] = 0.0  # a padded position with a wild ratio: masked out, so it must not matter
    batch = make_batch(mask, adv, old)
    loss, metrics = ClippedPGLoss(ClippedPGLoss.Config())(logprobs, batch, GlobalCounts(tokens=5, sequences=2))
    assert loss.item() == pytest.approx(-(2 + 2 - 1 - 1 - 1) / 5)
    assert metrics["actor/ratio_mean"] == pytest.approx(1.0)
    assert metrics["actor/clip_frac_low"] == 0.0 and metrics["actor/clip_frac_high"] == 0.0
    (grad,) = torch.autograd.grad(loss, logprobs)
    torch.testing.assert_close(grad, -adv * mask / 5)


def test_aggregation_mode_is_used(make_batch):
    logprobs = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0]], dtype=torch.float64)
    batch = make_batch([[1, 1, 0], [1, 0, 0]], adv, logprobs.clone())
    counts = GlobalCounts(tokens=3, sequences=2)
    seq_mean = ClippedPGLoss(ClippedPGLoss.Config(agg_mode="seq-mean-token-mean"))(logprobs, batch, counts)[0]
    seq_sum = ClippedPGLoss(ClippedPGLoss.Config(agg_mode="seq-mean-token-sum"))(logprobs, batch, counts)[0]
    assert seq_mean.item() == pytest.approx(-((1 + 3) / 2 + 2) / 2)
    assert seq_sum.item() == pytest.approx(-((1 + 3) + 2) / 2)


def test_kl_term_and_metrics(make_batch):
    logprobs = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    ref = torch.tensor([[-2.0, -1.0]], dtype=torch.float64)  # log-ratios +1, -1
    entropy = torch.tensor([[0.3, 0.5]], dtype=torch.float64)
    batch = make_batch(torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.float64), logprobs.clone(), ref_logprobs=ref)
    counts = GlobalCounts(tokens=2, sequences=1)
    mean_k3 = (math.exp(-1) + (math.e - 2)) / 2  # k3 = exp(-d) + d - 1 at d = +1, -1

    loss, metrics = ClippedPGLoss(ClippedPGLoss.Config(kl_coef=0.1))(logprobs, batch, counts, entropy=entropy)
    assert loss.item() == pytest.approx(0.1 * mean_k3)
    assert metrics["loss/kl"] == pytest.approx(0.1 * mean_k3) and metrics["loss/pg"] == 0.0
    assert metrics["actor/kl"] == pytest.approx(mean_k3)
    assert metrics["actor/entropy"] == pytest.approx(0.4)

    k1_loss, _ = ClippedPGLoss(ClippedPGLoss.Config(kl_coef=0.1, kl_estimator="k1"))(logprobs, batch, counts)
    assert k1_loss.item() == pytest.approx(0.1 * (1 - 1) / 2)

    # kl_coef 0: the reference does not enter the loss, but its KL is still reported
    loss0, metrics0 = ClippedPGLoss(ClippedPGLoss.Config())(logprobs, batch, counts)
    assert loss0.item() == 0.0 and metrics0["actor/kl"] == pytest.approx(mean_k3)


def test_missing_fields_and_bad_config_are_named(make_batch):
    logprobs, zeros = torch.zeros(1, 2), torch.zeros(1, 2)
    counts = GlobalCounts(tokens=2, sequences=1)
    batch = make_batch(torch.ones(1, 2), zeros, zeros)
    with pytest.raises(ValueError, match="ref_logprobs"):
        ClippedPGLoss(ClippedPGLoss.Config(kl_coef=0.1))(logprobs, batch, counts)
    with pytest.raises(ValueError, match="advantages"):
        ClippedPGLoss(ClippedPGLoss.Config())(logprobs, make_batch(torch.ones(1, 2), None, zeros), counts)
    with pytest.raises(ValueError, match="shape"):
        ClippedPGLoss(ClippedPGLoss.Config())(torch.zeros(1, 3), batch, counts)
    with pytest.raises(ValueError, match="token-mean"):
        ClippedPGLoss(ClippedPGLoss.Config(agg_mode="mean"))
    with pytest.raises(KeyError, match="k3"):
        ClippedPGLoss(ClippedPGLoss.Config(kl_estimator="k5"))
    with pytest.raises(ValueError, match="epsilon"):
        ClippedPGLoss(ClippedPGLoss.Config(epsilon=1.5))
    assert "ref_logprobs" in ClippedPGLoss(ClippedPGLoss.Config(kl_coef=0.1)).reads
    assert "ref_logprobs" not in ClippedPGLoss(ClippedPGLoss.Config()).reads
    assert LOSSES.get("clipped_pg") is ClippedPGLoss


def test_truncated_importance_sampling_weights_the_surrogate_by_old_over_generation(make_batch):
    # ratio 1 everywhere (logprobs = old), A = [+1, -1, +1]; the engine's log-probs put
    # pi_old / pi_gen at 0.5, 1.5 and 4 (capped at 2): w = 0.5, 1.5, 2
    old = torch.full((1, 3), OLD, dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, 1.0]], dtype=torch.float64)
    batch = make_batch(torch.ones(1, 3), adv, old)
    batch.generation_logprobs = OLD - torch.log(torch.tensor([[0.5, 1.5, 4.0]], dtype=torch.float64))
    logprobs = logprobs_for([[1.0, 1.0, 1.0]])
    counts = GlobalCounts(tokens=3, sequences=1)
    loss_fn = ClippedPGLoss(ClippedPGLoss.Config(importance_sampling_cap=2.0))
    assert "generation_logprobs" in loss_fn.reads
    loss, metrics = loss_fn(logprobs, batch, counts)
    # per token -A * w: -0.5, +1.5, -2.0, token-mean over 3
    assert loss.item() == pytest.approx((-0.5 + 1.5 - 2.0) / 3)
    (grad,) = torch.autograd.grad(loss, logprobs)  # d/d logprob of -w A r = -w A r / 3, with r = 1
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 1.5, -2.0]], dtype=torch.float64) / 3)
    assert metrics["actor/is_weight_mean"] == pytest.approx((0.5 + 1.5 + 2.0) / 3)
    assert metrics["actor/is_capped_frac"] == pytest.approx(1 / 3)

    plain_loss, plain_metrics = ClippedPGLoss(ClippedPGLoss.Config())(logprobs, batch, counts)
    assert plain_loss.item() == pytest.approx(-1 / 3)  # off: the generation log-probs are not read
    assert "actor/is_weight_mean" not in plain_metrics


def test_importance_sampling_needs_generation_logprobs(make_batch):
    batch = make_batch(torch.ones(1, 2), torch.ones(1, 2, dtype=torch.float64), torch.full((1, 2), OLD, dtype=torch.float64))
    loss_fn = ClippedPGLoss(ClippedPGLoss.Config(importance_sampling_cap=2.0))
    with pytest.raises(ValueError, match="generation_logprobs"):
        loss_fn(logprobs_for([[1.0, 1.0]]), batch, GlobalCounts(tokens=2, sequences=1))
    with pytest.raises(ValueError, match="importance_sampling_cap"):
        ClippedPGLoss(ClippedPGLoss.Config(importance_sampling_cap=-1.0))
