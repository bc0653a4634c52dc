"""The Megatron backend's checkpoint size estimate (models/megatron/checkpoint_size.py), worked out by
hand for a world of 4 ranks: TP=2 x DP=2, the experts at EP=2 (so their data-parallel group has 2 ranks)."""

import torch

from aligner_ext.models.megatron.checkpoint_size import Copies, rank_share, sharded_checkpoint_bytes

COPIES = Copies(data_parallel=2, tensor_parallel=2, expert_data_parallel=2, expert_tensor_parallel=1)


def parameter(values: int, split: bool = False, expert: bool = False) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.zeros(values))
    param.tensor_model_parallel = split
    if expert:
        param.allreduce = False  # megatron-core's mark of an expert's weight
    return param


def test_each_global_value_is_counted_once_over_the_world():
    # one rank holds: half of a TP-split projection of 12 values (6), a replicated norm of 4 values,
    # and half of the experts' 16 values (8; the other EP rank holds the rest)
    params = [parameter(6, split=True), parameter(4), parameter(8, expert=True)]
    assert COPIES.of(params[0]) == 2  # one copy per DP rank
    assert COPIES.of(params[1]) == 4  # per DP rank and per TP rank
    assert COPIES.of(params[2]) == 2  # per rank of the experts' data-parallel group
    share = rank_share(params, COPIES)
    assert share == 6 / 2 + 4 / 4 + 8 / 2  # = 8
    assert 4 * share == 12 + 4 + 16  # four such ranks: every global value once


def test_bytes_per_value_follow_the_dtype():
    # bf16 weight 2 + AdamW's two float32 moments 8 + float32 master 4 = 14 bytes; float32: 4 + 8 = 12
    assert sharded_checkpoint_bytes(32, torch.bfloat16) == 32 * 14
    assert sharded_checkpoint_bytes(32, torch.float32) == 32 * 12
    # weights-only (trainer.save_optimizer=false): the weight alone
    assert sharded_checkpoint_bytes(32, torch.bfloat16, optimizer=False) == 32 * 2
