"""Resuming a weights-only checkpoint (`trainer.save_optimizer=false`, trainer/loop.py::holds_optimizer):
refused in one line where the run asks for exact resume, else resumed with the optimizer afresh; the HF
policy's state without the optimizer restores the schedule and leaves AdamW's moments and the float32
masters to the loaded weights. The whole run through the CLI: tests/e2e/test_weights_only.py."""

import copy
import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from aligner_ext.errors import CheckpointError
from aligner_ext.models.hf import HFPolicy
from aligner_ext.models.settings import OptimConfig, PolicyConfig
from aligner_ext.trainer.loop import holds_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_checkpoint_bytes import train_once  # noqa: E402


def settings(save_optimizer: bool):
    return SimpleNamespace(trainer=SimpleNamespace(save_optimizer=save_optimizer))


def test_an_exact_resume_of_a_weights_only_checkpoint_is_refused_in_one_line(tmp_path, caplog):
    path = tmp_path / "step_3"
    assert holds_optimizer(settings(True), path, {"weights_only": False})
    assert holds_optimizer(settings(True), path, {})  # written before weights-only checkpoints existed
    with pytest.raises(CheckpointError) as refused:
        holds_optimizer(settings(True), path, {"weights_only": True})
    message = str(refused.value)
    assert f"checkpoint {path} holds the weights without the optimizer's state" in message and "\n" not in message
    assert "trainer.save_optimizer=false" in message and "trainer.resume=false" in message
    with caplog.at_level(logging.WARNING):
        assert not holds_optimizer(settings(False), path, {"weights_only": True})
    assert "start afresh" in caplog.text


def test_the_hf_policy_resumes_a_weights_only_state_with_a_fresh_optimizer(tiny_model):
    cfg = PolicyConfig(device="cpu", dtype="bfloat16", micro_batch_size=2, optim=OptimConfig(master_weights=True))
    trained = HFPolicy(copy.deepcopy(tiny_model), cfg, total_steps=10)
    train_once(trained, tiny_model.config.vocab_size)
    state = trained.state_dict(optimizer=False)
    assert sorted(state) == ["nonfinite_guard", "scheduler", "version"]

    resumed = HFPolicy(copy.deepcopy(trained.model), cfg, total_steps=10)  # the checkpoint's weights
    resumed.masters.pairs[0][1].add_(1.0)  # a master that differs from its weight: the load must replace it
    resumed.load_state_dict(state)
    assert resumed.scheduler.last_epoch == trained.scheduler.last_epoch > 0  # the schedule continues
    assert not resumed.optimizer.state  # AdamW starts afresh
    assert resumed.masters.pairs
    for param, master in resumed.masters.pairs:
        assert torch.equal(master, param.float())  # the masters are the loaded bf16 weights
