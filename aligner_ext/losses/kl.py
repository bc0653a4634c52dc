"""Per-token estimators of KL(pi || ref) from log-probs of tokens sampled from pi.

With the log-ratio ``d = logprob - ref_logprob`` of a sampled token (Schulman, "Approximating KL
Divergence", 2020):

    k1 = d                          unbiased, high variance, can be negative
    k2 = d^2 / 2                    biased, low variance, never negative
    k3 = exp(-d) - (-d) - 1         unbiased, low variance, never negative ("low_var_kl" in verl)

Decision: ``d`` is clamped to [-20, 20] before any estimator. A token the reference finds far less
likely than the policy (padding, a reference that never saw the template) would otherwise make
``exp(-d)`` overflow to inf and turn the whole loss into NaN; e^20 ~ 5e8 is already far past any
useful penalty. Past the clamp the gradient is zero, which is what we want from such outliers.

Names follow verl's aliases too (``kl`` = k1, ``mse`` = k2, ``low_var_kl`` = k3).
"""

from __future__ import annotations

import torch

from aligner_ext.registry import Registry

KL_ESTIMATORS = Registry("KL estimator")

KL_LOG_RATIO_CLAMP = 20.0  # |logprob - ref_logprob| bound before estimating, in nats


def _log_ratio(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    return (logprobs - ref_logprobs).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)


@KL_ESTIMATORS.register("k1", "kl")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """[b, R] k1 = logprob - ref_logprob."""
    return _log_ratio(logprobs, ref_logprobs)


@KL_ESTIMATORS.register("k2", "mse")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """[b, R] k2 = (logprob - ref_logprob)^2 / 2."""
    return 0.5 * _log_ratio(logprobs, ref_logprobs).square()


@KL_ESTIMATORS.register("k3", "low_var_kl")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """[b, R] k3 = exp(ref - logprob) - (ref - logprob) - 1."""
    neg = -_log_ratio(logprobs, ref_logprobs)
    return torch.expm1(neg) - neg
