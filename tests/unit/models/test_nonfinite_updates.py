"""Non-finite updates: the HF policy skips an update whose loss or gradient is NaN / infinite
(weights and optimizer state untouched, the skip counted), stops the run after
`max_nonfinite_in_a_row` in a row, carries its counts through a checkpoint; a checkpoint of
non-finite weights is refused and `latest` keeps naming the last finite one."""

import math

import pytest
import torch

from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.models.base import NonFiniteGuard, NonFiniteUpdates
from aligner_ext.models.settings import OptimConfig
from aligner_ext.trainer.checkpoint import LATEST, Checkpointer
from test_hf_policy import make_policy, ragged_batch


class PoisonedLoss(ClippedPGLoss):
    """The clipped loss, times NaN or infinity on the updates listed (counted from 0)."""

    def __init__(self, poisoned: dict[int, float]):
        super().__init__(ClippedPGLoss.Config())
        self.poisoned, self.update = poisoned, 0

    def global_counts(self, batch):
        self.update += 1
        return super().global_counts(batch)

    def __call__(self, logprobs, batch, counts):
        value, metrics = super().__call__(logprobs, batch, counts)
        return value * self.poisoned.get(self.update - 1, 1.0), metrics


def prepared(policy, tokenizer):
    batch = ragged_batch(len(tokenizer))
    batch.advantages = batch.response_mask.double()
    batch.old_logprobs, _ = policy.logprobs(batch, temperature=1.0)
    return batch


def snapshot(policy):
    return [p.detach().clone() for p in policy.model.parameters()]


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_non_finite_update_is_skipped_and_counted(tiny_model, tiny_tokenizer, poison):
    policy = make_policy(tiny_model, mini_batch_size=3)  # two updates per step: rows 0-2, rows 3-4
    batch = prepared(policy, tiny_tokenizer)
    before = snapshot(policy)
    metrics = policy.train(batch, PoisonedLoss({0: poison, 1: 0.0}), temperature=1.0)  # 0.0: finite, no change
    assert metrics["actor/skipped_updates"] == 1 and metrics["actor/num_updates"] == 1
    assert math.isfinite(metrics["actor/grad_norm"])
    after = snapshot(policy)
    assert all(torch.isfinite(p).all() for p in after)
    # the skipped update left no gradient behind: the applied one had a zero loss, so AdamW's first
    # step moved nothing (decoupled weight decay is 0), and its step count is 1, not 2
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    steps = {int(state["step"]) for state in policy.optimizer.state.values()}
    assert steps == {1}
    assert policy.state_dict()["nonfinite_guard"] == {"in_a_row": 0, "skipped": 1}


def test_updates_after_a_skip_train_normally(tiny_model, tiny_tokenizer):
    policy = make_policy(tiny_model)
    batch = prepared(policy, tiny_tokenizer)
    policy.train(batch, PoisonedLoss({0: float("nan")}), temperature=1.0)
    before = snapshot(policy)
    metrics = policy.train(batch, PoisonedLoss({}), temperature=1.0)
    assert metrics["actor/num_updates"] == 1 and metrics["actor/skipped_updates"] == 0
    assert any(not torch.equal(a, b) for a, b in zip(before, snapshot(policy)))


def test_the_run_stops_after_the_limit_in_a_row(tiny_model, tiny_tokenizer):
    policy = make_policy(tiny_model, optim=OptimConfig(max_nonfinite_in_a_row=2))
    batch = prepared(policy, tiny_tokenizer)
    before = snapshot(policy)
    metrics = policy.train(batch, PoisonedLoss({0: float("nan")}), temperature=1.0)
    assert math.isnan(metrics["actor/grad_norm"]) and metrics["actor/num_updates"] == 0
    with pytest.raises(NonFiniteUpdates, match="2 optimizer updates in a row.*policy.optim.lr"):
        policy.train(batch, PoisonedLoss({0: float("inf")}), temperature=1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(policy)))


def test_the_guard_counts_survive_a_checkpoint_and_reset_on_a_finite_update():
    guard = NonFiniteGuard(limit=3)
    assert not guard.admit(float("nan")) and not guard.admit(1.0, loss=float("-inf"))
    restored = NonFiniteGuard(limit=3)
    restored.load_state_dict(guard.state_dict())
    with pytest.raises(NonFiniteUpdates):  # the third in a row, counted across the save
        restored.admit(float("nan"))
    fresh = NonFiniteGuard(limit=3)
    fresh.load_state_dict(guard.state_dict())
    assert fresh.admit(0.5, loss=2.0) and fresh.state_dict() == {"in_a_row": 0, "skipped": 2}
    with pytest.raises(ValueError, match="max_nonfinite_in_a_row"):
        NonFiniteGuard(limit=0)


def test_non_finite_weights_are_never_saved(tmp_path, tiny_model, tiny_tokenizer):
    checkpointer = Checkpointer(tmp_path, keep_last=0)
    checkpointer.save(1, tiny_model, tiny_tokenizer, {"loader": 1})
    with torch.no_grad():
        next(tiny_model.parameters())[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="not saving step 2: non-finite values"):
        checkpointer.save(2, tiny_model, tiny_tokenizer, {"loader": 2})
    assert (tmp_path / "checkpoints" / LATEST).read_text().strip() == "step_1"
    assert not (tmp_path / "checkpoints" / "step_2").exists()
    assert checkpointer.latest() == tmp_path / "checkpoints" / "step_1"
