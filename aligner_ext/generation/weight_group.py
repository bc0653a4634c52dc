"""A process group of its own between trainer rank 0 (rank 0 of the group) and generation servers
(ranks `rank_offset`...), for broadcasting weights in memory. It is built from a TCPStore directly,
not through `init_process_group`, so it coexists with the trainer's torchrun group and needs none in
a server. The payloads follow SGLang's weight-update endpoints (/init_weights_update_group,
/update_weights_from_distributed), so the same trainer code drives an SGLang server."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def dtype_name(dtype: torch.dtype) -> str:
    """The name a tensor's dtype travels under (the keys of DTYPES)."""
    return str(dtype).removeprefix("torch.")


def describe(named: list[tuple[str, torch.Tensor]]) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtype names, shapes) of the tensors a broadcast sends, in order."""
    return [name for name, _ in named], [dtype_name(t.dtype) for _, t in named], [list(t.shape) for _, t in named]


class WeightGroup:
    """One member of the weight-broadcast group; rank 0 (the trainer) hosts the store."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, backend: str,
                 group_name: str = "weight_sync", timeout_s: float = 300.0):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight group backend must be gloo or nccl, got {backend!r}")
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore(group_name, store)
        self.rank, self.world_size = rank, world_size
        self._store = store  # the store must outlive the group
        if backend == "nccl":
            self._group = dist.ProcessGroupNCCL(prefixed, rank, world_size)
        else:
            self._group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every member's `tensor` (same shape and dtype), in place."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._group.broadcast([tensor], options).wait()
