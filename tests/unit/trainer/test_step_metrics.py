"""Metrics logged every step: prompt lengths, the engine-vs-trainer log-prob gap, staleness."""

import pytest
import torch

from aligner_ext.trainer.step_metrics import batch_metrics, logprob_mismatch, staleness_metrics


def test_prompt_lengths_count_real_tokens_not_padding(make_batch):
    batch = make_batch([[1, 0], [1, 1], [1, 1]], rewards=[1.0, 0.0, 1.0], advantages=torch.zeros(3, 2))
    batch.prompt_mask = torch.tensor([[False, False, True, True], [True, True, True, True],
                                      [False, True, True, True]])  # left-padded: 2, 4 and 3 real tokens
    batch.prompt_ids = torch.ones(3, 4, dtype=torch.long)
    batch.entropy, batch.correct = torch.zeros(3, 2), torch.tensor([1.0, 0.0, 1.0])
    metrics = batch_metrics(batch)
    assert metrics["prompt/length_mean"] == pytest.approx(3.0) and metrics["prompt/length_max"] == 4


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


def test_staleness_histogram_and_gap_per_lag_by_hand(make_batch):
    batch = make_batch([[1, 1, 1], [1, 1, 0]], old_logprobs=torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]]))
    batch.generation_logprobs = torch.tensor([[-1.5, -2.0, -2.0], [-1.25, -1.0, 7.0]])
    batch.staleness = torch.tensor([[0, 1, 1], [2, 0, 9]])  # the padding's 9 is not a token
    metrics = staleness_metrics(batch)
    # lags of the 5 tokens: 0, 1, 1, 2, 0
    assert metrics["staleness/mean"] == pytest.approx(4 / 5)
    assert metrics["staleness/max"] == 2
    assert [metrics[f"staleness/share_lag_{lag}"] for lag in (0, 1, 2)] == pytest.approx([2 / 5, 2 / 5, 1 / 5])
    assert "staleness/share_lag_9" not in metrics
    # gaps: lag 0 -> 0.5 and 0; lag 1 -> 0 and 1; lag 2 -> 0.25
    assert metrics["rollout/logprob_diff_mean_lag_0"] == pytest.approx(0.25)
    assert metrics["rollout/logprob_diff_mean_lag_1"] == pytest.approx(0.5)
    assert metrics["rollout/logprob_diff_mean_lag_2"] == pytest.approx(0.25)


def test_no_staleness_metrics_without_versions(make_batch):
    assert staleness_metrics(make_batch([[1, 1]], old_logprobs=torch.zeros(1, 2))) == {}
