"""GSPO and CISPO against float64 references written from their papers' formulas: hand-worked ratios where
every clip branch fires, gradients, the first update, and the aggregation modes and settings each refuses."""

import math

import pytest
import torch

from aligner_ext.config import load_config
from aligner_ext.context import BuildContext
from aligner_ext.errors import ConfigError
from aligner_ext.losses.base import LOSSES, GlobalCounts
from aligner_ext.losses.cispo import CISPOLoss
from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.losses.gspo import GSPOLoss
from aligner_ext.losses.settings import LossConfig
from aligner_ext.trainer.build import construct

SEQ = "seq-mean-token-mean"


def gspo_config(**overrides) -> LossConfig:
    return LossConfig(agg_mode=SEQ, **overrides)


def gspo_reference(logprobs, old, adv, mask, low, high):
    """-(1/N_seq) sum_i min(s_i A_i, clip(s_i, 1 - low, 1 + high) A_i), s_i = exp(mean over the sequence's
    tokens of logprob - old): the GSPO paper's sequence objective, with A_i read from the first token."""
    terms = []
    for i in range(logprobs.shape[0]):
        tokens = mask[i]
        if not tokens.any():
            continue
        s = torch.exp((logprobs[i][tokens] - old[i][tokens]).mean())
        a = adv[i][tokens][0]
        terms.append(torch.minimum(s * a, s.clamp(1 - low, 1 + high) * a))
    return -torch.stack(terms).sum() / len(terms)


def test_gspo_hand_worked_clips_per_sequence(make_batch):
    # row 0: log-ratios 0.3, -0.1, 0.1 -> s = e^0.1 = 1.105 > 1 + 4e-4 with A = +1: clipped, J = 1.0004
    # row 1: log-ratios 1e-4, -3e-4 -> s = e^-1e-4, inside [1 - 3e-4, 1 + 4e-4] with A = -1: J = -s
    old = torch.full((2, 3), -1.0, dtype=torch.float64)
    logprobs = (old + torch.tensor([[0.3, -0.1, 0.1], [1e-4, -3e-4, 0.0]], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3], dtype=torch.float64)
    batch = make_batch([[1, 1, 1], [1, 1, 0]], adv * torch.tensor([[1, 1, 1], [1, 1, 0]]), old)
    loss, metrics = GSPOLoss(gspo_config())(logprobs, batch, GlobalCounts(tokens=5, sequences=2))
    s1 = math.exp(-1e-4)
    assert loss.item() == pytest.approx((-(1 + 4e-4) + s1) / 2, abs=1e-12)
    assert metrics["actor/clip_frac_high"] == pytest.approx(3 / 5) and metrics["actor/clip_frac_low"] == 0.0
    assert metrics["actor/seq_ratio_mean"] == pytest.approx((3 * math.exp(0.1) + 2 * s1) / 5)
    # the clipped sequence gets no gradient; each token of row 1: (1/2 sequences)(1/2 tokens) * -A * s
    (grad,) = torch.autograd.grad(loss, logprobs)
    expected = torch.tensor([[0.0, 0.0, 0.0], [s1 / 4, s1 / 4, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("seed", range(4))
def test_gspo_token_form_has_the_sequence_objectives_value_and_gradient(make_batch, seed):
    gen = torch.Generator().manual_seed(seed)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 1, 3, 0, 4, 2])[:, None]
    old = -torch.rand(6, 5, generator=gen, dtype=torch.float64) * 3
    logprobs = (old + 0.08 * torch.randn(6, 5, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(6, 1, generator=gen, dtype=torch.float64).expand(6, 5) * mask
    low, high = 0.01, 0.02  # wide enough for both sides of the clip to fire on these ratios
    batch = make_batch(mask, adv, old)
    counts = GlobalCounts(tokens=int(mask.sum()), sequences=int(mask.any(dim=1).sum()))
    cfg = gspo_config()
    cfg.gspo.epsilon, cfg.gspo.epsilon_high = low, high
    loss, metrics = GSPOLoss(cfg)(logprobs, batch, counts)
    reference = gspo_reference(logprobs, old, adv, mask, low, high)
    assert loss.item() == pytest.approx(reference.item(), abs=1e-12)
    assert metrics["actor/clip_frac_low"] + metrics["actor/clip_frac_high"] > 0
    (grad,) = torch.autograd.grad(loss, logprobs)
    (expected,) = torch.autograd.grad(reference, logprobs)
    torch.testing.assert_close(grad, expected)


def test_gspo_on_the_first_update_is_the_sequence_mean_policy_gradient(make_batch):
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([[2.0], [-1.0]], dtype=torch.float64) * mask
    batch = make_batch(mask, adv, logprobs.detach().clone())
    loss, _ = GSPOLoss(gspo_config())(logprobs, batch, GlobalCounts(tokens=5, sequences=2))
    assert loss.item() == pytest.approx(-(2 - 1) / 2)
    (grad,) = torch.autograd.grad(loss, logprobs)
    torch.testing.assert_close(grad, -adv / mask.sum(dim=1, keepdim=True) / 2)


def test_gspo_refuses_token_level_modes_and_the_dual_clip():
    with pytest.raises(ValueError, match=r"loss.agg_mode=token-mean is not defined for loss gspo \(its ratio, clip "
                                         r"and advantage are per sequence\); it takes seq-mean-token-mean"):
        GSPOLoss(LossConfig(agg_mode="token-mean"))
    with pytest.raises(ValueError, match="loss.agg_mode=seq-mean-token-sum is not defined for loss gspo"):
        GSPOLoss(LossConfig(agg_mode="seq-mean-token-sum"))
    with pytest.raises(ValueError, match="off_policy_correction=token_tis is not defined for loss gspo"):
        GSPOLoss(gspo_config(importance_sampling_cap=2.0))  # the cap alone means token_tis
    with pytest.raises(ValueError, match="off_policy_correction=token_mask is not defined for loss gspo"):
        GSPOLoss(gspo_config(off_policy_correction="token_mask"))
    with pytest.raises(ValueError, match="loss.clip_ratio_c=3 is clipped_pg's dual clip; loss gspo does not read it"):
        GSPOLoss(gspo_config(clip_ratio_c=3.0))
    assert "generation_logprobs" in GSPOLoss(gspo_config(off_policy_correction="sequence_mask")).reads
    assert LOSSES.get("gspo") is GSPOLoss and LOSSES.get("cispo") is CISPOLoss


def cispo_reference(logprobs, old, adv, mask, low, high):
    """(1/N_tok) sum_t -sg(clip(r_t, low, high)) A_t logprob_t (MiniMax-M1, token-level normalisation)."""
    weight = torch.exp(logprobs.detach() - old).clamp(low, high)
    return (torch.where(mask, -weight * adv * logprobs, 0.0)).sum() / mask.sum()


def test_cispo_clips_the_weight_and_keeps_every_tokens_gradient(make_batch):
    # ratios 0.5, 1, 5 and 8 with epsilon_high 3: weights 0.5, 1, 4, 4 (no lower clip: epsilon = 1)
    old = torch.full((1, 4), -1.0, dtype=torch.float64)
    logprobs = (old + torch.log(torch.tensor([[0.5, 1.0, 5.0, 8.0]], dtype=torch.float64))).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 2.0, -0.5]], dtype=torch.float64)
    batch = make_batch(torch.ones(1, 4), adv, old)
    loss, metrics = CISPOLoss(LossConfig())(logprobs, batch, GlobalCounts(tokens=4, sequences=1))
    weights = torch.tensor([[0.5, 1.0, 4.0, 4.0]], dtype=torch.float64)
    assert loss.item() == pytest.approx((-weights * adv * logprobs.detach()).sum().item() / 4)
    assert metrics["actor/clip_frac_high"] == pytest.approx(2 / 4) and metrics["actor/clip_frac_low"] == 0.0
    (grad,) = torch.autograd.grad(loss, logprobs)
    torch.testing.assert_close(grad, -weights * adv / 4)  # the clipped tokens keep a gradient (PPO's would be 0)
    # a lower clip at 1 - 0.2 lifts the 0.5 weight to 0.8
    cfg = LossConfig()
    cfg.cispo.epsilon = 0.2
    low_clipped, low_metrics = CISPOLoss(cfg)(logprobs, batch, GlobalCounts(tokens=4, sequences=1))
    torch.testing.assert_close(torch.autograd.grad(low_clipped, logprobs)[0],
                               -torch.tensor([[0.8, 1.0, 4.0, 4.0]], dtype=torch.float64) * adv / 4)
    assert low_metrics["actor/clip_frac_low"] == pytest.approx(1 / 4)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_cispo_matches_the_reference_and_the_first_update_is_the_policy_gradient(make_batch, mode):
    gen = torch.Generator().manual_seed(3)
    mask = torch.arange(4)[None, :] < torch.tensor([4, 2, 3])[:, None]
    old = -torch.rand(3, 4, generator=gen, dtype=torch.float64) * 2
    logprobs = (old + torch.randn(3, 4, generator=gen, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(3, 4, generator=gen, dtype=torch.float64) * mask
    counts = GlobalCounts(tokens=9, sequences=3)
    loss, _ = CISPOLoss(LossConfig(agg_mode="token-mean"))(logprobs, make_batch(mask, adv, old), counts)
    reference = cispo_reference(logprobs, old, adv, mask, 0.0, 4.0)
    assert loss.item() == pytest.approx(reference.item(), abs=1e-12)
    torch.testing.assert_close(torch.autograd.grad(loss, logprobs)[0], torch.autograd.grad(reference, logprobs)[0])
    # on the first update (old == logprobs) CISPO's gradient is clipped_pg's, in every aggregation mode
    on_policy = make_batch(mask, adv, logprobs.detach().clone())
    grads = [torch.autograd.grad(cls(LossConfig(agg_mode=mode))(logprobs, on_policy, counts)[0], logprobs)[0]
             for cls in (CISPOLoss, ClippedPGLoss)]
    torch.testing.assert_close(grads[0], grads[1])


def test_cispo_refuses_the_dual_clip():
    with pytest.raises(ValueError, match="loss cispo does not read it"):
        CISPOLoss(LossConfig(clip_ratio_c=3.0))


def test_the_build_turns_a_refused_mode_into_one_line_naming_the_loss_and_its_section():
    cfg = load_config("base", ["algorithm.loss=gspo"])
    cfg.loss.agg_mode = "token-mean"  # refused at load (tests/unit/config/test_late_refusals.py); here the build's own
    ctx = BuildContext(cfg=cfg, tokenizer=None, policy=None, engine=None, rewards=None)
    with pytest.raises(ConfigError) as refused:
        construct(cfg, "loss", "algorithm.loss", "gspo", GSPOLoss, lambda cls: cls.from_context(ctx), section="loss")
    assert str(refused.value) == ("loss gspo (algorithm.loss; its settings: loss) cannot be built: loss.agg_mode="
                                  "token-mean is not defined for loss gspo (its ratio, clip and advantage are per "
                                  "sequence); it takes seq-mean-token-mean")
