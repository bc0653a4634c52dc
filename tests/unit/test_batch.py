import pytest
import torch

from aligner_ext.batch import ExperienceBatch, SampleInfo, concat_batches, routing_fields
from aligner_ext.data.types import PromptRow
from aligner_ext.generation.base import NOT_RECORDED

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


def with_routing(batch, first: int):
    """`batch` with routing [layers 2, k 1] numbering its real tokens first, first + 1, ... row by row
    (NOT_RECORDED on pads), laid out as the ids."""
    mask = batch.attention_mask.bool()
    routing = torch.full((*mask.shape, 2, 1), NOT_RECORDED, dtype=torch.int16)
    routing[mask] = torch.arange(first, first + int(mask.sum()), dtype=torch.int16)[:, None, None].expand(-1, 2, 1)
    width = batch.prompt_ids.shape[1]
    batch.prompt_routing, batch.response_routing = routing[:, :width], routing[:, width:]
    return batch


def test_concat_and_select_keep_each_tokens_routing_beside_it():
    """Dynamic sampling's refill: batches of other widths stacked, then rows picked; every real token keeps
    its routing, the new pads are NOT_RECORDED."""
    a = with_routing(make_batch([[1, 2]], [[3]], [0]), first=10)
    b = with_routing(make_batch([[4]], [[5, 6, 7]], [1]), first=20)
    both = concat_batches([a, b], pad_token_id=PAD)
    assert both.routing[..., 0, 0].tolist() == [[10, 11, 12, NOT_RECORDED, NOT_RECORDED],
                                                [NOT_RECORDED, 20, 21, 22, 23]]
    assert both.select([1]).routing[0, :, 1, 0].tolist() == [NOT_RECORDED, 20, 21, 22, 23]


def test_routing_fields_lay_each_rows_tokens_out_as_the_ids():
    first = torch.tensor([[[1]], [[2]], [[3]]], dtype=torch.int16)  # prompt of 2, response of 1
    second = torch.tensor([[[4]], [[5]], [[6]]], dtype=torch.int16)  # prompt of 1, response of 2
    prompts, responses = routing_fields([first, second, None], [2, 1, 2], prompt_width=2, response_width=2,
                                        shape=(1, 1))
    assert prompts[..., 0, 0].tolist() == [[1, 2], [NOT_RECORDED, 4], [NOT_RECORDED, NOT_RECORDED]]
    assert responses[..., 0, 0].tolist() == [[3, NOT_RECORDED], [5, 6], [NOT_RECORDED, NOT_RECORDED]]
