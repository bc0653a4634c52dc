"""Off-policy corrections (truncated and masked importance sampling, per token and per sequence) against a
float64 reference written from their formulas, in every loss; the settings each refuses."""

import math

import pytest
import torch

from aligner_ext.losses.base import GlobalCounts
from aligner_ext.losses.cispo import CISPOLoss
from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.losses.gspo import GSPOLoss
from aligner_ext.losses.off_policy import OffPolicyCorrection
from aligner_ext.losses.settings import LossConfig

# pi_old / pi_gen per token: row 0 (3 tokens) 0.4, 1.5, 3.0; row 1 (2 tokens) 1.2, 1.1 and a padded position
RATIOS = [[0.4, 1.5, 3.0], [1.2, 1.1, 1.0]]
MASK = torch.tensor([[True, True, True], [True, True, False]])
COUNTS = GlobalCounts(tokens=5, sequences=2)


def reference_weights(mode, cap=2.0, low=0.5, high=2.0):
    """w per token from the definitions: min(rho, C) | min(prod rho, C) | rho 1[in bounds] | prod rho 1[in bounds]."""
    rows = []
    for ratios, valid in zip(RATIOS, MASK.tolist()):
        kept = [r for r, v in zip(ratios, valid) if v]
        seq = math.prod(kept)
        per_token = {"token_tis": [min(r, cap) for r in ratios], "sequence_tis": [min(seq, cap)] * 3,
                     "token_mask": [r if low <= r <= high else 0.0 for r in ratios],
                     "sequence_mask": [seq if low <= seq <= high else 0.0] * 3}[mode]
        rows.append(per_token)
    return torch.tensor(rows, dtype=torch.float64)


def batch_with_engine(make_batch, adv=None):
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    batch = make_batch(MASK, torch.ones(2, 3, dtype=torch.float64) if adv is None else adv, old)
    batch.generation_logprobs = old - torch.log(torch.tensor(RATIOS, dtype=torch.float64))
    batch.generation_logprobs[1, 2] = 50.0  # garbage on padding must not reach a sequence product
    return batch


@pytest.mark.parametrize("mode", ["token_tis", "sequence_tis", "token_mask", "sequence_mask"])
def test_weights_match_the_definitions(make_batch, mode):
    cap = 2.0 if mode.endswith("tis") else 0.0
    correction = OffPolicyCorrection(mode, cap, 0.5, 2.0, log_ratio_clamp=20.0)
    weights = correction(batch_with_engine(make_batch))
    torch.testing.assert_close(weights.weight[MASK], reference_weights(mode)[MASK])
    # row 0's sequence ratio is 0.4 * 1.5 * 3 = 1.8, row 1's 1.32: both inside [0.5, 2], under the cap 2
    expected_active = {"token_tis": [[0, 0, 1], [0, 0]], "sequence_tis": [[0, 0, 0], [0, 0]],
                       "token_mask": [[1, 0, 1], [0, 0]], "sequence_mask": [[0, 0, 0], [0, 0]]}[mode]
    assert weights.active[MASK].tolist() == [bool(flag) for row in expected_active for flag in row]


def test_a_sequence_outside_the_bounds_is_dropped_whole(make_batch):
    correction = OffPolicyCorrection("sequence_mask", 0.0, 0.5, 1.5, log_ratio_clamp=20.0)
    weights = correction(batch_with_engine(make_batch))  # row 0's 1.8 > 1.5: every token of it weighs 0
    assert weights.weight[0].tolist() == [0.0, 0.0, 0.0] and weights.active[0].all()
    assert weights.weight[1, :2].tolist() == pytest.approx([1.32, 1.32])


@pytest.mark.parametrize("mode", ["token_tis", "sequence_tis", "token_mask", "sequence_mask"])
def test_clipped_pg_weights_its_terms_not_its_kl_and_keeps_the_normaliser(make_batch, mode):
    adv = torch.tensor([[1.0, -2.0, 0.5], [-1.0, 3.0, 0.0]], dtype=torch.float64)
    batch = batch_with_engine(make_batch, adv)
    batch.ref_logprobs = batch.old_logprobs - 0.5
    logprobs = batch.old_logprobs.clone().requires_grad_()  # first update: pg_t = -A_t
    cap = 2.0 if mode.endswith("tis") else 0.0
    cfg = LossConfig(off_policy_correction=mode, importance_sampling_cap=cap, kl_coef=0.1)
    loss, metrics = ClippedPGLoss(cfg)(logprobs, batch, COUNTS)
    w = reference_weights(mode)
    kl = 0.1 * (math.exp(-0.5) + 0.5 - 1)  # k3 = e^d - d - 1 at d = ref - logprob = -0.5, every token, unweighted
    assert metrics["loss/pg"] == pytest.approx((-(w * adv)[MASK]).sum().item() / 5)  # masked tokens stay in N_tok
    assert metrics["loss/kl"] == pytest.approx(kl)
    assert loss.item() == pytest.approx(metrics["loss/pg"] + kl)
    assert metrics["actor/is_weight_mean"] == pytest.approx(w[MASK].mean().item())
    share = "actor/is_capped_frac" if mode.endswith("tis") else "actor/is_masked_frac"
    active = {"token_tis": 1, "sequence_tis": 0, "token_mask": 2, "sequence_mask": 0}[mode]
    assert metrics[share] == pytest.approx(active / 5)


def test_the_cap_alone_is_token_tis_as_before(make_batch):
    batch = batch_with_engine(make_batch)
    logprobs = batch.old_logprobs.clone()
    alone = ClippedPGLoss(LossConfig(importance_sampling_cap=2.0))
    explicit = ClippedPGLoss(LossConfig(off_policy_correction="token_tis", importance_sampling_cap=2.0))
    assert alone.correction.mode == "token_tis" and "generation_logprobs" in alone.reads
    (alone_loss, alone_metrics), (explicit_loss, explicit_metrics) = (loss(logprobs, batch, COUNTS)
                                                                      for loss in (alone, explicit))
    assert alone_loss.item() == explicit_loss.item() and alone_metrics == explicit_metrics
    assert "generation_logprobs" not in ClippedPGLoss(LossConfig()).reads


@pytest.mark.parametrize("loss_cls, mode, agg", [(CISPOLoss, "token_mask", "token-mean"),
                                                 (CISPOLoss, "sequence_tis", "seq-mean-token-sum"),
                                                 (GSPOLoss, "sequence_mask", "seq-mean-token-mean"),
                                                 (GSPOLoss, "sequence_tis", "seq-mean-token-mean")])
def test_every_loss_takes_the_correction(make_batch, loss_cls, mode, agg):
    batch = batch_with_engine(make_batch)
    logprobs = batch.old_logprobs.clone().requires_grad_()
    cap = 2.0 if mode.endswith("tis") else 0.0
    corrected = loss_cls(LossConfig(agg_mode=agg, off_policy_correction=mode, importance_sampling_cap=cap))
    plain = loss_cls(LossConfig(agg_mode=agg))
    w = reference_weights(mode)
    grad = torch.autograd.grad(corrected(logprobs, batch, COUNTS)[0], logprobs)[0]
    plain_grad = torch.autograd.grad(plain(logprobs, batch, COUNTS)[0], logprobs)[0]
    torch.testing.assert_close(grad, plain_grad * w)  # the weight scales each token's gradient, detached


@pytest.mark.parametrize("settings, message", [
    (dict(off_policy_correction="sequence_tis"), "sequence_tis truncates at loss.importance_sampling_cap, which is 0"),
    (dict(off_policy_correction="token_mask", importance_sampling_cap=2.0),
     "loss.importance_sampling_cap=2 is read only by token_tis and sequence_tis"),
    (dict(off_policy_correction="token_mask", importance_sampling_low=1.5), "must satisfy 0 < low <= 1 <= high"),
    (dict(importance_sampling_cap=-1.0), "importance_sampling_cap must be >= 0"),
    (dict(off_policy_correction="bogus"), "unknown loss.off_policy_correction 'bogus'"),
])
def test_settings_that_contradict_the_mode_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        ClippedPGLoss(LossConfig(**settings))


def test_a_sequence_product_is_clamped_before_exp(make_batch):
    batch = batch_with_engine(make_batch)
    batch.generation_logprobs[0] = -1000.0  # rho = e^999 per token: the sum is clamped at 20 nats
    weights = OffPolicyCorrection("sequence_tis", 2.0, 0.5, 2.0, log_ratio_clamp=20.0)(batch)
    assert torch.isfinite(weights.weight).all() and weights.weight[0].tolist() == [2.0, 2.0, 2.0]
