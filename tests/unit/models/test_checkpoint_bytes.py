"""The HF backend's checkpoint size estimate (`HFPolicy.checkpoint_bytes`, read before step 1 by
trainer/disk_space.py) against the parameter count, and against the tensors its state holds once trained."""

import copy
import sys
from pathlib import Path

import torch

from aligner_ext.adapters import adapter_state
from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.models.hf import HFPolicy
from aligner_ext.models.settings import LoraConfig, OptimConfig, PolicyConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_hf_policy import ragged_batch  # noqa: E402


def train_once(policy: HFPolicy, vocab: int) -> None:
    batch = ragged_batch(vocab)
    batch.advantages = torch.linspace(-1, 1, batch.response_ids.numel()).view_as(batch.response_ids)
    batch.advantages = (batch.advantages * batch.response_mask).to(torch.float64)
    policy.train(batch, ClippedPGLoss(ClippedPGLoss.Config()), temperature=1.0)


def state_tensor_bytes(state) -> int:
    """Bytes of every tensor of more than one value in a nested state (Adam's step counts left out)."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size() if state.numel() > 1 else 0
    if isinstance(state, dict):
        return sum(state_tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_tensor_bytes(value) for value in state)
    return 0


def test_bf16_weights_with_float32_masters(tiny_model):
    parameters = sum(param.numel() for param in tiny_model.parameters())
    policy = HFPolicy(copy.deepcopy(tiny_model), PolicyConfig(device="cpu", dtype="bfloat16", micro_batch_size=2,
                                                              optim=OptimConfig(master_weights=True)), total_steps=10)
    estimate = policy.checkpoint_bytes()
    # bf16 weight 2 + float32 master 4 + AdamW's two float32 moments 8 = 14 bytes per parameter
    assert estimate == 14 * parameters
    assert policy.export_bytes() == 2 * parameters
    train_once(policy, tiny_model.config.vocab_size)
    weights = 2 * parameters  # model.safetensors
    assert estimate == weights + state_tensor_bytes(policy.state_dict())  # masters and moments, as saved
    # weights-only (trainer.save_optimizer=false): no masters or moments in the saved state
    assert policy.checkpoint_bytes(optimizer=False) == weights
    assert state_tensor_bytes(policy.state_dict(optimizer=False)) == 0


def test_lora_saves_the_adapters_and_their_moments_alone(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path / "base")
    base = type(tiny_model).from_pretrained(tmp_path / "base")
    policy = HFPolicy(base, PolicyConfig(device="cpu", dtype="float64", micro_batch_size=2,
                                         lora=LoraConfig(rank=4, alpha=8.0)), total_steps=10)
    adapters = sum(value.numel() for value in adapter_state(policy.model).values())
    assert 0 < adapters < sum(param.numel() for param in tiny_model.parameters()) / 4
    estimate = policy.checkpoint_bytes()
    assert estimate == 3 * 8 * adapters  # float64 adapters and their two float64 moments
    train_once(policy, tiny_model.config.vocab_size)
    assert estimate == 8 * adapters + state_tensor_bytes(policy.state_dict())
