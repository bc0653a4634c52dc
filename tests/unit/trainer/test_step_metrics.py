"""The engine-vs-trainer log-prob gap logged every step."""

import pytest
import torch

from aligner_ext.trainer.step_metrics import logprob_mismatch


def test_gap_over_generated_tokens_by_hand(make_batch):
    batch = make_batch([[1, 1, 0], [1, 0, 0]], old_logprobs=torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -7.0, 0.0]]))
    batch.generation_logprobs = torch.tensor([[-1.5, -2.0, 0.0], [-0.25, 0.0, 0.0]])
    # generated tokens: |-1.5 + 1| = 0.5, 0, |-0.25 + 0.5| = 0.25; the padding is not counted
    metrics = logprob_mismatch(batch)
    assert metrics["rollout/logprob_diff_mean"] == pytest.approx(0.75 / 3)
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(0.5)


def test_nothing_to_log_without_engine_logprobs(make_batch):
    batch = make_batch([[1, 1]], old_logprobs=torch.zeros(1, 2))
    assert logprob_mismatch(batch) == {}
