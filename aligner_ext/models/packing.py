"""Sequences packed end to end: several rows of a batch laid in one row with no pads between them,
for micro-batches that compute nothing on pads (both backends, `policy.micro_batch_tokens`).

`token_micro_batches` groups rows under a token budget; `pack_end_to_end` lays a group's sequences
(prompt without its left padding, then the valid response) in one row, with each token's position
in its own sequence (RoPE restarts at 0 per sequence) and the sequences' cumulative lengths (the
boundaries attention must not cross, `models/attention.py`). The row may be padded at its end (the
Megatron backend's: on a GPU a multiple of 16, aligner_ext/widths.py, and of TP under sequence parallelism;
the common width of a pipeline's micro-batches); the tail pad is a sequence of its own, so no real
token attends to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from aligner_ext.batch import ExperienceBatch


@dataclass
class PackedRow:
    """One micro-batch as a single row, on the CPU."""

    ids: torch.Tensor  # [1, S] int64 the sequences end to end, then the tail pad
    positions: torch.Tensor  # [1, S] int64 each token's position in its own sequence
    cu_seqlens: torch.Tensor  # [n + 1] int32 boundaries (0, len_0, len_0 + len_1, ..., S), the tail pad included
    max_seqlen: int
    response_index: torch.Tensor  # [N] int64 position of the hidden state predicting each valid response token
    response_ids: torch.Tensor  # [N] int64 those tokens (row-major over the batch's response_valid)


def valid_responses(micro: ExperienceBatch, first_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index, ids) of the valid response tokens, where response token t of row i is predicted by flat
    index first_index[i] + t."""
    valid = micro.response_valid
    index = first_index.unsqueeze(1) + torch.arange(valid.shape[1])
    return index[valid], micro.response_ids[valid]


def pack_end_to_end(micro: ExperienceBatch, pad_token_id: int, multiple_of: int = 1, width: int = 0) -> PackedRow:
    """`micro`'s sequences end to end in one row, padded to a multiple of `multiple_of` and to at least
    `width`; built on the CPU wherever `micro` lives."""
    micro = micro.to(torch.device("cpu"))
    prompt_lengths, response_lengths = micro.prompt_mask.sum(dim=1), micro.response_valid.sum(dim=1)
    if bool((prompt_lengths == 0).any()):
        raise ValueError(f"rows {torch.nonzero(prompt_lengths == 0).flatten().tolist()} have an empty prompt")
    lengths = prompt_lengths + response_lengths
    total = int(lengths.sum())
    padded = max(width, total)
    padded += -padded % multiple_of
    ids = torch.full((1, padded), pad_token_id, dtype=torch.long)
    ids[0, :total] = micro.input_ids[micro.attention_mask.bool()]  # row by row: prompt, then response
    sizes = lengths.tolist() + ([padded - total] if padded > total else [])
    positions = torch.cat([torch.arange(n) for n in sizes]).unsqueeze(0)
    cu_seqlens = F.pad(torch.tensor(sizes).cumsum(0), (1, 0)).to(torch.int32)
    index, response_ids = valid_responses(micro, cu_seqlens[: len(micro)].long() + prompt_lengths - 1)
    return PackedRow(ids, positions, cu_seqlens, max(sizes), index, response_ids)


def token_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Rows grouped so each group's total length stays within `budget` tokens (a longer row alone):
    longest first, each into the first group with room (first-fit decreasing)."""
    groups: list[list[int]] = []
    room: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):
        target = next((g for g, free in enumerate(room) if free >= lengths[row]), None)
        if target is None:
            groups.append([])
            room.append(budget)
            target = len(groups) - 1
        groups[target].append(row)
        room[target] -= lengths[row]
    return groups
