"""`rollout/identical_group_fraction`: the share of groups whose samples are token-identical, which every
group reaching under sampling means sampling that does not vary (trainer/no_learning.py warns)."""

import pytest
import torch

from aligner_ext.data.loader import DataConfig, PromptLoader
from aligner_ext.experience.base import GroupSampling, RolloutConfig, identical_samples
from test_group_sampling import ScriptedEngine, arithmetic_row, rewards  # noqa: F401 - the fixture


def test_identical_groups_count_by_tokens_with_the_padding_apart(make_batch):
    # three groups of two: identical; differing in a token; a response [7, 2] against [7] padded with 2
    valid = [[1, 1], [1, 1], [1, 1], [1, 0], [1, 1], [1, 0]]
    batch = make_batch(valid, group_ids=[0, 0, 1, 1, 2, 2])
    batch.response_ids = torch.tensor([[7, 2], [7, 2], [7, 2], [8, 2], [7, 2], [7, 2]])
    batch.response_valid = torch.tensor(valid, dtype=torch.bool)
    assert identical_samples(batch) == {"rollout/identical_group_fraction": pytest.approx(1 / 3)}


def test_groups_of_one_sample_are_not_counted(make_batch):
    batch = make_batch([[1], [1], [1]], group_ids=[0, 1, 1])
    batch.response_ids = torch.tensor([[4], [5], [6]])
    assert identical_samples(batch) == {"rollout/identical_group_fraction": 0.0}  # only group 1 counts: it differs
    assert identical_samples(make_batch([[1], [1]], group_ids=[0, 1])) == {}  # no group of two: nothing to measure


@pytest.mark.parametrize("texts, expected", [
    (["\\boxed{5}"], 1.0),  # every sample of both prompts the same text
    (["a", "b", "c"], 0.0),  # three different texts in each group
    (["a", "a", "a", "b", "a", "a"], 0.5),  # the first prompt's three samples agree, the second's do not
])
def test_group_sampling_reports_the_share_of_identical_groups(tiny_tokenizer, rewards, texts, expected):
    loader = PromptLoader([arithmetic_row(0, 2, 3), arithmetic_row(1, 10, 1)], tiny_tokenizer, DataConfig(),
                          batch_size=2, shuffle=False)
    maker = GroupSampling(RolloutConfig(n=3), ScriptedEngine(tiny_tokenizer, texts), rewards, tiny_tokenizer)
    _, metrics = maker.make_experience(loader, step=0)
    assert metrics["rollout/identical_group_fraction"] == expected
