"""Float32 master weights of a bf16 policy on the HF backend (models/master_weights.py): an update at a
typical RL learning rate moves the weights as float32 training does, instead of rounding away, and a
resume continues from the masters exactly."""

import copy

import pytest
import torch

from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.models.hf import HFPolicy
from aligner_ext.models.settings import OptimConfig, PolicyConfig
from test_hf_policy import ragged_batch

LR = 1e-6  # the base config's learning rate; bf16 spacing at the tiny model's weights (~0.016) is ~6e-5


@pytest.fixture
def start(tiny_model):
    """The tiny model with weights that bf16 holds exactly, so float32 and bf16 runs start equal."""
    return tiny_model.to(torch.bfloat16).to(torch.float32)


def trained(model, vocab: int, dtype: str, master_weights: bool = True, steps: int = 1) -> HFPolicy:
    """A policy of a copy of `model` after `steps` on-policy updates on the same batch and advantages."""
    policy = HFPolicy(copy.deepcopy(model), PolicyConfig(device="cpu", dtype=dtype, micro_batch_size=2, optim=OptimConfig(
        lr=LR, master_weights=master_weights)), total_steps=10)
    for _ in range(steps):
        batch = ragged_batch(vocab)
        batch.advantages = torch.linspace(-1, 1, batch.response_ids.numel()).view_as(batch.response_ids)
        batch.advantages = batch.advantages * batch.response_mask
        policy.train(batch, ClippedPGLoss(ClippedPGLoss.Config()), temperature=1.0)
    return policy


def flat(tensors) -> torch.Tensor:
    return torch.cat([tensor.detach().float().flatten() for tensor in tensors])


def test_a_bf16_update_at_lr_1e_6_moves_every_master_by_adams_step(start, tiny_tokenizer):
    """Adam's first step is lr * g / (|g| + eps) per element (m = g, v = g^2 after bias correction; no
    weight decay), worked out here in float64 from the masters' float32 gradient: every element with a
    gradient moves by it, to the master's float32 rounding."""
    policy = trained(start, len(tiny_tokenizer), "bfloat16")
    assert all(param.dtype == torch.bfloat16 for param in policy.model.parameters())
    assert all(master.dtype == torch.float32 for master in policy.trainable)
    grad = flat(master.grad for master in policy.trainable).double()
    expected = -LR * grad / (grad.abs() + 1e-8)
    moved = flat(policy.trainable).double() - flat(start.parameters()).double()
    has_gradient = grad != 0
    assert has_gradient.float().mean() > 0.99
    assert (moved[has_gradient] != 0).all()
    magnitude = torch.maximum(flat(start.parameters()).abs(), flat(policy.trainable).abs()).double()
    # the master's float32 spacing, and a few float32 roundings of the step's own arithmetic
    assert ((moved - expected).abs() <= magnitude * 2.0 ** -23 + expected.abs() * 1e-6).all()
    # the model's bf16 weights, which the rollout engine computes from, are the masters rounded
    for param, master in zip(policy.model.parameters(), policy.trainable):
        assert torch.equal(param, master.to(torch.bfloat16))


def test_bf16_with_masters_moves_as_float32_training_and_without_them_rounds_away(start, tiny_tokenizer):
    """The same update in float32 and in bf16: with masters nearly every element float32 moves moves the
    same way (a few differ where bf16's forward rounds a tiny gradient to zero or flips its sign);
    AdamW on the bf16 weights themselves keeps only the few weights near zero."""
    origin = flat(start.parameters())
    in_float32 = flat(trained(start, len(tiny_tokenizer), "float32").model.parameters()) - origin
    with_masters = flat(trained(start, len(tiny_tokenizer), "bfloat16").trainable) - origin
    without = flat(trained(start, len(tiny_tokenizer), "bfloat16", master_weights=False).model.parameters()) - origin
    moves = in_float32 != 0
    assert moves.float().mean() > 0.99
    assert (with_masters[moves] != 0).float().mean() > 0.999
    same = (with_masters[moves] - in_float32[moves]).abs() <= 0.01 * in_float32[moves].abs()
    assert same.float().mean() > 0.99
    assert (without[moves] != 0).float().mean() < 0.1


def test_a_resume_continues_from_the_masters_exactly(start, tiny_tokenizer):
    """Two steps in one go against one step, a save (the bf16 weights and the policy's state) and a
    resumed second step: the masters agree bit for bit. Without the saved masters the resumed run
    would restart from the rounded bf16 weights and lose the first update."""
    vocab = len(tiny_tokenizer)
    straight = trained(start, vocab, "bfloat16", steps=2)
    first = trained(start, vocab, "bfloat16", steps=1)
    saved_weights, saved_state = copy.deepcopy(first.model.state_dict()), copy.deepcopy(first.state_dict())
    assert len(saved_state["master_weights"]) == len(first.trainable)
    resumed_model = copy.deepcopy(start)
    resumed = HFPolicy(resumed_model, PolicyConfig(device="cpu", dtype="bfloat16", micro_batch_size=2,
                                                   optim=OptimConfig(lr=LR)), total_steps=10)
    resumed.model.load_state_dict(saved_weights)
    resumed.load_state_dict(saved_state)
    batch = ragged_batch(vocab)
    batch.advantages = torch.linspace(-1, 1, batch.response_ids.numel()).view_as(batch.response_ids)
    resumed.train(batch, ClippedPGLoss(ClippedPGLoss.Config()), temperature=1.0)
    assert not torch.equal(flat(resumed.trainable), flat(first.trainable))
    assert torch.equal(flat(resumed.trainable), flat(straight.trainable))
    assert torch.equal(flat(resumed.model.parameters()), flat(straight.model.parameters()))


def test_a_checkpoint_without_masters_starts_them_from_its_weights(start, tiny_tokenizer):
    """A checkpoint of a run before masters existed holds bf16 weights and a bf16 optimizer state: the
    masters are its weights, and the optimizer's moments become float32."""
    old = trained(start, len(tiny_tokenizer), "bfloat16", master_weights=False)
    state = old.state_dict()
    assert "master_weights" not in state
    policy = HFPolicy(copy.deepcopy(start), PolicyConfig(device="cpu", dtype="bfloat16", optim=OptimConfig(lr=LR)),
                      total_steps=10)
    policy.model.load_state_dict(old.model.state_dict())
    policy.load_state_dict(state)
    assert torch.equal(flat(policy.trainable), flat(old.model.parameters()))
    moments = policy.optimizer.state[policy.trainable[0]]
    assert moments["exp_avg"].dtype == torch.float32
