"""Runs under `torchrun --nproc_per_node=2` (gloo, CPU), launched by test_process_groups.py: a layout
made again keeps its process groups, another layout gets new ones, a switch back to an earlier layout
restores its groups, and a partition of the ranks asked
for again is the same group; no call that reuses groups adds one to torch's registry. Exits non-zero
(an AssertionError) where that fails."""

import torch.distributed as dist
from megatron.core import parallel_state

from aligner_ext.models.megatron.parallel import init_distributed, init_model_parallel, partition_group


def registered() -> int:
    """How many process groups torch holds (each keeps its threads and sockets)."""
    return len(dist.distributed_c10d._world.pg_map)


def main() -> None:
    init_distributed()
    init_model_parallel(2, 1)
    tensor_group, count = parallel_state.get_tensor_model_parallel_group(), registered()
    init_model_parallel(2, 1, seed=3)
    assert parallel_state.get_tensor_model_parallel_group() is tensor_group
    assert registered() == count, (registered(), count)
    init_model_parallel(1, 2)
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    assert parallel_state.get_pipeline_model_parallel_world_size() == 2
    assert registered() > count  # another layout: megatron-core's groups made anew
    count = registered()
    init_model_parallel(2, 1)  # back to the first layout: its groups again, none made
    assert parallel_state.get_tensor_model_parallel_group() is tensor_group
    assert parallel_state.get_tensor_model_parallel_world_size() == 2
    assert parallel_state.get_pipeline_model_parallel_world_size() == 1
    assert registered() == count, (registered(), count)
    init_model_parallel(1, 2)
    assert parallel_state.get_pipeline_model_parallel_world_size() == 2
    assert registered() == count, (registered(), count)
    pair, count = partition_group([[0, 1]], backend="gloo"), registered()
    assert partition_group([[1, 0]], backend="gloo") is pair
    assert registered() == count
    alone = partition_group([[0], [1]])
    assert dist.get_process_group_ranks(alone) == [dist.get_rank()]
    assert partition_group([[1], [0]]) is alone
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
