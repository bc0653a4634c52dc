"""The Megatron sequence layouts: rows rolled so prompts start at column 0, filler rows, and
sequences packed end to end under a token budget."""

import pytest
import torch

pytest.importorskip("megatron.core")

from aligner_ext.batch import ExperienceBatch, SampleInfo  # noqa: E402
from aligner_ext.models.megatron.forward import pack, pack_sequences, pad_rows  # noqa: E402
from aligner_ext.models.megatron.model import pack_rows  # noqa: E402

PAD = 99


def test_pack_rows_moves_left_padding_to_the_end_and_points_at_the_predicting_columns():
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    input_ids = torch.tensor([[0, 5, 6, 7, 8], [1, 2, 3, 4, 0]])  # prompt width 3, response width 2
    ids, positions, columns = pack_rows(prompt_mask, input_ids, PAD)
    assert ids.tolist() == [[5, 6, 7, 8, PAD], [1, 2, 3, 4, 0]]
    assert positions.tolist() == [[0, 1, 2, 3, 4]] * 2  # = HF position ids of the real tokens
    # row 0: prompt of 2 -> column 1 predicts response token 0 (id 7), column 2 token 1 (id 8)
    assert columns.tolist() == [[1, 2], [2, 3]]


def test_pack_rows_rejects_an_empty_prompt():
    with pytest.raises(ValueError, match=r"rows \[1\] have an empty prompt"):
        pack_rows(torch.tensor([[1, 1], [0, 0]], dtype=torch.bool), torch.zeros(2, 3, dtype=torch.long), PAD)


def _batch(rows: int) -> ExperienceBatch:
    return ExperienceBatch(
        prompt_ids=torch.arange(rows * 2).view(rows, 2) + 1, prompt_mask=torch.ones(rows, 2, dtype=torch.bool),
        response_ids=torch.ones(rows, 3, dtype=torch.long), response_valid=torch.ones(rows, 3, dtype=torch.bool),
        response_mask=torch.ones(rows, 3, dtype=torch.bool), group_ids=torch.arange(rows),
        samples=[SampleInfo(row=None) for _ in range(rows)],
    )


def test_pad_rows_adds_rows_that_count_nowhere():
    padded = pad_rows(_batch(1), 3)
    assert len(padded) == 3
    assert padded.prompt_ids[1:].tolist() == [[1, 2], [1, 2]]
    assert padded.response_mask.sum(dim=1).tolist() == [3, 0, 0]
    assert padded.response_valid.sum(dim=1).tolist() == [3, 0, 0]


def test_pack_pads_the_width_for_sequence_parallel():
    packed = pack(_batch(2), PAD, torch.device("cpu"), multiple_of=4)  # width 5 -> 8
    assert packed.ids.shape == (2, 8) and packed.ids[:, 5:].eq(PAD).all()
    # row r's hidden states sit at flat index r * 8 + column: columns 1, 2, 3 predict its 3 response tokens
    assert packed.response_index.tolist() == [1, 2, 3, 9, 10, 11]


def _ragged() -> ExperienceBatch:
    """Row 0: prompt [5] (left-padded), response [7, 8]; row 1: prompt [1, 2], response [3] then a pad."""
    return ExperienceBatch(
        prompt_ids=torch.tensor([[0, 5], [1, 2]]), prompt_mask=torch.tensor([[0, 1], [1, 1]], dtype=torch.bool),
        response_ids=torch.tensor([[7, 8], [3, 0]]), response_valid=torch.tensor([[1, 1], [1, 0]], dtype=torch.bool),
        response_mask=torch.tensor([[1, 1], [1, 0]], dtype=torch.bool), group_ids=torch.arange(2),
        samples=[SampleInfo(row=None) for _ in range(2)],
    )


def test_pack_sequences_lays_the_real_tokens_end_to_end_with_their_own_positions():
    packed = pack_sequences(_ragged(), PAD, torch.device("cpu"), multiple_of=4)  # 3 + 3 tokens -> 8
    assert packed.ids.tolist() == [[5, 7, 8, 1, 2, 3, PAD, PAD]]
    assert packed.positions.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1]]  # each sequence from 0; the tail pad too
    assert packed.boundaries.cu_seqlens_q.tolist() == [0, 3, 6, 8] and packed.boundaries.max_seqlen_q == 3
    # token 7 is predicted by the hidden state of 5 (index 0), 8 by 7's (1), 3 by 2's (4)
    assert packed.response_index.tolist() == [0, 1, 4]
    assert packed.response_ids.tolist() == [7, 8, 3]


def test_pack_sequences_pads_to_the_width_a_pipeline_needs():
    packed = pack_sequences(_ragged(), PAD, torch.device("cpu"), width=10)
    assert packed.ids.shape == (1, 10) and packed.boundaries.cu_seqlens_q.tolist() == [0, 3, 6, 10]
