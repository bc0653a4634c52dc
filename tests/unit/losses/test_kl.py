"""KL estimators k1 / k2 / k3 on hand-worked log-ratios."""

import math

import pytest
import torch

from aligner_ext.losses.kl import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3

# log-ratios d = logprob - ref: +1, -1, 0, and +-30 (clamped to +-20)
LOGPROBS = torch.tensor([[-1.0, -2.0, -0.5, -1.0, -31.0]], dtype=torch.float64)
REF = torch.tensor([[-2.0, -1.0, -0.5, -31.0, -1.0]], dtype=torch.float64)


def test_k1_is_the_log_ratio():
    assert kl_k1(LOGPROBS, REF)[0].tolist() == pytest.approx([1.0, -1.0, 0.0, 20.0, -20.0])


def test_k2_is_half_the_squared_log_ratio():
    assert kl_k2(LOGPROBS, REF)[0].tolist() == pytest.approx([0.5, 0.5, 0.0, 200.0, 200.0])


def test_k3_is_exp_minus_linear_minus_one():
    # k3 = exp(-d) + d - 1
    expected = [math.exp(-1), math.e - 2, 0.0, math.exp(-20) + 19, math.exp(20) - 21]
    assert kl_k3(LOGPROBS, REF)[0].tolist() == pytest.approx(expected, rel=1e-12)


def test_k3_stays_finite_and_gradients_vanish_past_the_clamp():
    logprobs = torch.tensor([0.0, -500.0], requires_grad=True)
    value = kl_k3(logprobs, torch.tensor([-500.0, 0.0]))
    assert torch.isfinite(value).all()
    (grad,) = torch.autograd.grad(value.sum(), logprobs)
    assert grad.tolist() == [0.0, 0.0]


def test_names_and_aliases():
    assert KL_ESTIMATORS.get("k1") is kl_k1 and KL_ESTIMATORS.get("kl") is kl_k1
    assert KL_ESTIMATORS.get("k2") is kl_k2 and KL_ESTIMATORS.get("mse") is kl_k2
    assert KL_ESTIMATORS.get("k3") is kl_k3 and KL_ESTIMATORS.get("low_var_kl") is kl_k3
    with pytest.raises(KeyError, match="k3"):
        KL_ESTIMATORS.get("k4")
