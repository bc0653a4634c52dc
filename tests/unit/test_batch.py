import pytest
import torch

from aligner_ext.batch import ExperienceBatch, SampleInfo, concat_batches
from aligner_ext.data.types import PromptRow

PAD = 0


def make_batch(prompts, responses, group_ids, rewards=None):
    width_p = max(len(p) for p in prompts)
    width_r = max(len(r) for r in responses)
    prompt_ids = torch.tensor([[PAD] * (width_p - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[False] * (width_p - len(p)) + [True] * len(p) for p in prompts])
    response_ids = torch.tensor([r + [PAD] * (width_r - len(r)) for r in responses])
    valid = torch.tensor([[True] * len(r) + [False] * (width_r - len(r)) for r in responses])
    samples = [SampleInfo(row=PromptRow(row_id=f"r{i}", messages=[], data_source="x")) for i in range(len(prompts))]
    return ExperienceBatch(prompt_ids, prompt_mask, response_ids, valid, valid.clone(),
                           torch.tensor(group_ids), samples, rewards=rewards)


def test_positions_ignore_left_padding():
    batch = make_batch([[5, 6, 7], [8]], [[9, 10], [11]], [0, 1])
    # row 0: no padding -> 0..4 over the 5 real tokens, then the response pad repeats the last position
    # row 1: two pads on the left -> positions start at 0 on token 8
    assert batch.input_ids.tolist() == [[5, 6, 7, 9, 10], [0, 0, 8, 11, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 0, 1, 1, 0]]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4]
    assert batch.position_ids[1].tolist()[2:4] == [0, 1]
    assert batch.response_lengths.tolist() == [2, 1]


def test_select_keeps_rows_and_samples_aligned():
    batch = make_batch([[1], [2], [3]], [[4], [5, 6], [7]], [10, 11, 12], rewards=torch.tensor([0.0, 1.0, 2.0]))
    picked = batch.select([2, 0])
    assert picked.group_ids.tolist() == [12, 10]
    assert picked.rewards.tolist() == [2.0, 0.0]
    assert [s.row.row_id for s in picked.samples] == ["r2", "r0"]


def test_concat_repads_prompts_left_and_responses_right():
    a = make_batch([[1, 2]], [[3]], [0], rewards=torch.tensor([1.0]))
    b = make_batch([[4]], [[5, 6, 7]], [1], rewards=torch.tensor([0.0]))
    both = concat_batches([a, b], pad_token_id=PAD)
    assert both.prompt_ids.tolist() == [[1, 2], [PAD, 4]]
    assert both.prompt_mask.tolist() == [[True, True], [False, True]]
    assert both.response_ids.tolist() == [[3, PAD, PAD], [5, 6, 7]]
    assert both.response_valid.tolist() == [[True, False, False], [True, True, True]]
    assert both.group_ids.tolist() == [0, 1]
    assert len(both.samples) == 2


def test_concat_refuses_partially_set_fields():
    a = make_batch([[1]], [[3]], [0], rewards=torch.tensor([1.0]))
    b = make_batch([[4]], [[5]], [1])
    with pytest.raises(ValueError, match="rewards"):
        concat_batches([a, b], pad_token_id=PAD)
