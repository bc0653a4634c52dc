"""Summing micro-batch losses (divided by global counts) gives the full-batch gradient and metrics, for
every loss and off-policy correction.

The policy is a tiny linear model: logprobs = log_softmax(features @ W^T) at fixed targets, in float64.
Six sequences of different lengths (one fully masked out), old log-probs off-policy so the clip
fires, and a KL term, for every aggregation mode.
"""

import pytest
import torch

from aligner_ext.losses.aggregation import AGG_MODES
from aligner_ext.losses.cispo import CISPOLoss
from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.losses.gspo import GSPOLoss
from aligner_ext.losses.settings import LossConfig

ROWS, WIDTH, DIM, VOCAB = 6, 5, 4, 7
LENGTHS = [5, 1, 3, 0, 4, 2]
SPLITS = {
    1: [[0, 1, 2, 3, 4, 5]],
    2: [[0, 1], [2, 3, 4, 5]],
    3: [[0], [1, 2, 3], [4, 5]],
}


@pytest.fixture
def setup(make_batch):
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(ROWS, WIDTH, DIM, generator=generator, dtype=torch.float64)
    weight = torch.randn(VOCAB, DIM, generator=generator, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(VOCAB, (ROWS, WIDTH), generator=generator)
    mask = torch.arange(WIDTH)[None, :] < torch.tensor(LENGTHS)[:, None]

    def policy(rows):
        logits = features[rows] @ weight.T
        return torch.log_softmax(logits, dim=-1).gather(-1, targets[rows, :, None])[..., 0]

    current = policy(list(range(ROWS))).detach()
    old = current + 0.4 * torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.float64)
    ref = current + 0.3 * torch.randn(ROWS, WIDTH, generator=generator, dtype=torch.float64)
    adv = torch.randn(ROWS, 1, generator=generator, dtype=torch.float64) * mask
    batch = make_batch(mask, adv, old, ref_logprobs=ref)
    return batch, policy, weight


def run(loss_fn, batch, policy, weight, splits, local_counts=False):
    """Gradient w.r.t. the weight and summed metrics over micro-batches `splits`."""
    full_counts = loss_fn.global_counts(batch)
    total = 0.0
    metrics = {}
    for rows in splits:
        micro = batch.select(rows)
        counts = loss_fn.global_counts(micro) if local_counts else full_counts
        value, micro_metrics = loss_fn(policy(rows), micro, counts)
        total = total + value
        for key, number in micro_metrics.items():
            metrics[key] = metrics.get(key, 0.0) + number
    (grad,) = torch.autograd.grad(total, weight)
    return grad, metrics


def assert_split_invariant(loss_fn, batch, policy, weight) -> dict[str, float]:
    """The gradient and metrics of 2 and 3 micro-batches equal the whole batch's; returns its metrics."""
    full_grad, full_metrics = run(loss_fn, batch, policy, weight, SPLITS[1])
    assert full_grad.abs().max() > 1e-3
    for count in (2, 3):
        grad, metrics = run(loss_fn, batch, policy, weight, SPLITS[count])
        assert torch.allclose(grad, full_grad, rtol=0, atol=1e-7), f"{count} micro-batches"
        assert metrics.keys() == full_metrics.keys()
        for key, value in full_metrics.items():
            assert metrics[key] == pytest.approx(value, abs=1e-9), key
    return full_metrics


@pytest.mark.parametrize("mode", list(AGG_MODES))
def test_gradient_and_metrics_do_not_depend_on_the_split(setup, mode):
    batch, policy, weight = setup
    loss_fn = ClippedPGLoss(ClippedPGLoss.Config(epsilon_high=0.28, agg_mode=mode, kl_coef=0.05))
    metrics = assert_split_invariant(loss_fn, batch, policy, weight)
    assert 0 < metrics["actor/clip_frac_low"] + metrics["actor/clip_frac_high"] < 1  # the clip fires


@pytest.mark.parametrize("mode", list(AGG_MODES))
def test_local_counts_would_not_be_invariant(setup, mode):
    # Sanity: the test above is sensitive to the normaliser.
    batch, policy, weight = setup
    loss_fn = ClippedPGLoss(ClippedPGLoss.Config(agg_mode=mode, kl_coef=0.05))
    full_grad, _ = run(loss_fn, batch, policy, weight, SPLITS[1])
    local_grad, _ = run(loss_fn, batch, policy, weight, SPLITS[2], local_counts=True)
    assert not torch.allclose(local_grad, full_grad, rtol=0, atol=1e-7)


@pytest.mark.parametrize("loss_cls, mode, correction", [
    (GSPOLoss, "seq-mean-token-mean", "none"), (GSPOLoss, "seq-mean-token-mean", "sequence_tis"),
    (GSPOLoss, "seq-mean-token-mean", "sequence_mask"),
    *[(CISPOLoss, mode, "none") for mode in AGG_MODES], (CISPOLoss, "token-mean", "token_mask"),
    *[(ClippedPGLoss, "token-mean", correction) for correction in ("token_tis", "sequence_tis", "token_mask",
                                                                    "sequence_mask")],
])
def test_the_other_losses_and_corrections_do_not_depend_on_the_split(setup, loss_cls, mode, correction):
    batch, policy, weight = setup
    generator = torch.Generator().manual_seed(1)
    batch.generation_logprobs = batch.old_logprobs + 0.3 * torch.randn(ROWS, WIDTH, generator=generator,
                                                                     dtype=torch.float64)
    cfg = LossConfig(agg_mode=mode, kl_coef=0.05, off_policy_correction=correction,
                     importance_sampling_cap=2.0 if correction.endswith("tis") else 0.0,
                     importance_sampling_low=0.8, importance_sampling_high=1.25)  # tight: some tokens are masked
    cfg.gspo.epsilon, cfg.gspo.epsilon_high = 0.05, 0.05  # wide enough that not every sequence is clipped
    metrics = assert_split_invariant(loss_cls(cfg), batch, policy, weight)
    assert 0 < metrics.get("actor/is_masked_frac", 0.5) < 1  # a mask drops some tokens, not all
