"""The loop's policy stage: the generation engine releases its memory before the policy's passes and
receives the weights only after the policy synced them, and that sync is timed as the weight-sync stage (a backend whose generation model is a copy,
the Megatron one, would otherwise sample the next rollouts from stale weights)."""

from types import SimpleNamespace

import torch

from aligner_ext.batch import ExperienceBatch, SampleInfo
from aligner_ext.data.types import PromptRow
from aligner_ext.trainer.loop import update_policy
from aligner_ext.trainer.metrics import StageTimer


class Recorder:
    """Fake policy, advantage estimator and engine, writing what is called, in order, into one list."""

    def fills_old_logprobs(self, batch_size):  # a backend that needs the separate old-log-prob pass
        return False

    def __init__(self):
        self.calls: list[str] = []
        self.model = object()
        self.version = 3  # the policy version the engine is told after the refit

    def logprobs(self, batch, temperature):
        self.calls.append("policy.logprobs")
        return torch.zeros(batch.response_ids.shape), torch.zeros(batch.response_ids.shape)

    def train(self, batch, loss, temperature):
        self.calls.append("policy.train")
        return {}

    def sync_weights(self):
        self.calls.append("policy.sync_weights")

    def __call__(self, batch):  # the advantage estimator
        self.calls.append("advantage")
        return torch.zeros(batch.response_ids.shape)

    def metrics(self):
        return {}

    def release_memory(self):
        self.calls.append("engine.release_memory")

    def update_weights(self, model):
        self.calls.append(f"engine.update_weights({'generation_model' if model is self.model else 'other'})")


def two_sample_batch() -> ExperienceBatch:
    valid = torch.tensor([[True, True], [True, False]])
    return ExperienceBatch(
        prompt_ids=torch.ones(2, 2, dtype=torch.long), prompt_mask=torch.ones(2, 2, dtype=torch.bool),
        response_ids=torch.ones(2, 2, dtype=torch.long), response_valid=valid, response_mask=valid.clone(),
        group_ids=torch.tensor([0, 0]), rewards=torch.tensor([1.0, 0.0]), correct=torch.tensor([1.0, 0.0]),
        samples=[SampleInfo(row=PromptRow(row_id=f"r{i}", messages=[], data_source="t"), finish_reason="eos")
                 for i in range(2)],
    )


def test_engine_gets_the_weights_after_the_policy_synced_them():
    recorder = Recorder()
    parts = SimpleNamespace(policy=recorder, reference=None, advantage=recorder, engine=recorder, loss=None,
                            generation_model=recorder.model)
    timer = StageTimer()
    update_policy(parts, two_sample_batch(), timer, temperature=1.0)
    # the engine frees what it holds before any training-side pass, and gets the weights after the sync
    assert recorder.calls == ["engine.release_memory", "policy.logprobs", "advantage", "policy.train",
                              "policy.sync_weights", "engine.update_weights(generation_model)"]
    assert recorder.weights_version == 3  # the engine knows which version it samples
    assert set(timer.metrics()) >= {"timing/train_s", "timing/weight_sync_s"}


def test_staleness_is_the_proximal_version_less_each_sampled_token_s():
    recorder = Recorder()
    parts = SimpleNamespace(policy=recorder, reference=None, advantage=recorder, engine=recorder, loss=None,
                            generation_model=recorder.model)
    batch = two_sample_batch()
    batch.generation_versions = torch.tensor([[3, 1], [2, 0]])  # row 1's second token is padding
    update_policy(parts, batch, StageTimer(), temperature=1.0)
    # the policy is at version 3 while it trains on the batch: 3 - 3, 3 - 1, 3 - 2; padding 0
    assert batch.staleness.tolist() == [[0, 2], [1, 0]]
