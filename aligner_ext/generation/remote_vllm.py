"""vLLM's weight-update interface, as the `remote` engine drives it (`generator.remote.server_kind=vllm`).

Read from vLLM's source, every release from 0.16.0 to 0.33.0 (docs/serving.md names the files). vLLM
serves these routes only when started with VLLM_SERVER_DEV_MODE=1.

- `disk` (vLLM >= 0.16): POST /pause; POST /collective_rpc `{"method": "reload_weights", "kwargs":
  {"weights_path": dir}}` (the worker's `reload_weights` loads every *.safetensors in `dir` in place);
  POST /resume.
- `distributed` (vLLM >= 0.21, server started with `--weight-transfer-config '{"backend": "nccl"}'`):
  once, GET /get_world_size on every server (its worker count) and POST /init_weight_transfer_engine
  `{"init_info": {"master_address", "master_port", "rank_offset", "world_size"}}` while the trainer opens
  rank 0 of the group with vLLM's own StatelessProcessGroup and PyNcclCommunicator (what vLLM's workers
  build; vLLM must be installed beside the trainer); each push: /pause, /start_weight_update
  `{"is_checkpoint_format": true}`, /update_weights `{"update_info": {"names", "dtype_names", "shapes"}}`
  while rank 0 broadcasts every tensor in that order, /finish_weight_update `{}`, /resume.

/pause with its defaults (mode `abort`, `clear_cache` true) also drops the KV and prefix caches, which
hold keys and values computed with the old weights; the trainer has no request in flight at that point.
"""

from __future__ import annotations

from typing import Callable

import torch

from aligner_ext.generation.weight_group import describe
from aligner_ext.weights_file import tied_groups

# (path, payload for server i) -> None: POSTs to every server at once (RemoteEngine._on_every_server)
OnEveryServer = Callable[[str, Callable[[int], dict]], None]


class NcclRank0:
    """Rank 0 of vLLM's trainer-to-workers NCCL group, built as vLLM's workers build theirs
    (vllm/distributed/weight_transfer/nccl_engine.py: StatelessProcessGroup.create, PyNcclCommunicator)."""

    def __init__(self, address: str, port: int, world_size: int, device: torch.device):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=address, port=port, rank=0, world_size=world_size)
        self._communicator = PyNcclCommunicator(group, device=device)  # returns once every worker has joined

    def broadcast(self, tensor: torch.Tensor) -> None:
        self._communicator.broadcast(tensor, src=0, stream=torch.cuda.current_stream())


def check_policy_device(device: torch.device) -> None:
    """`distributed` pushes over NCCL: the trainer's end needs a GPU (checked when the engine is built)."""
    if device.type != "cuda":
        raise ValueError(f"generator.remote.server_kind=vllm with weight_sync=distributed needs the policy on a GPU "
                         f"(it is on {device.type}): vLLM's workers receive weights over NCCL only; use "
                         f"generator.remote.weight_sync=disk")


def nccl_rank0(device: torch.device) -> Callable[[str, int, int], NcclRank0]:
    """A maker of the trainer's end of the group; checks first, before any server waits to join."""
    try:
        import vllm.distributed.device_communicators.pynccl  # noqa: F401
        import vllm.distributed.utils  # noqa: F401
    except ImportError as err:
        raise ImportError("generator.remote.server_kind=vllm with weight_sync=distributed needs vLLM installed beside "
                          "the trainer too (pip install 'aligner_ext[vllm]', the servers' version): vLLM's workers "
                          "join through vLLM's StatelessProcessGroup and PyNcclCommunicator") from err
    return lambda address, port, world_size: NcclRank0(address, port, world_size, device)


def with_tied_copies(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with a tied tensor's second and later names holding copies: a safetensors file keeps a
    tensor held by one storage under one name only (module docstring: why vLLM needs them all)."""
    aliases = {name for names in tied_groups(state) for name in names[1:]}
    return {name: value.clone() if name in aliases else value for name, value in state.items()}


def with_tied_names(named: list[tuple[str, torch.Tensor]],
                    state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """`named` and, for each of its tensors that `state` holds under more names (tied embeddings), those
    names with the same tensor (module docstring)."""
    tensors = dict(named)
    aliases = []
    for names in tied_groups(state):
        pushed = next((name for name in names if name in tensors), None)
        if pushed is not None:
            aliases += [(alias, tensors[pushed]) for alias in names if alias not in tensors]
    return named + aliases


def reload_from_disk(on_every_server: OnEveryServer, directory: str) -> None:
    """Every server reloads its weights from the safetensors files in `directory`."""
    on_every_server("/pause", lambda index: {})
    on_every_server("/collective_rpc", lambda index: {"method": "reload_weights", "kwargs": {"weights_path": directory}})
    on_every_server("/resume", lambda index: {})


def ranks(world_sizes: list[int]) -> tuple[list[int], int]:
    """(rank_offset of each server's first worker, group size): the trainer is rank 0, then each
    server's workers in turn."""
    offsets = [1 + sum(world_sizes[:index]) for index in range(len(world_sizes))]
    return offsets, 1 + sum(world_sizes)


def init_payload(address: str, port: int, offset: int, world_size: int) -> dict:
    return {"init_info": {"master_address": address, "master_port": port, "rank_offset": offset,
                          "world_size": world_size}}


def update_payload(named: list[tuple[str, torch.Tensor]]) -> dict:
    names, dtypes, shapes = describe(named)
    return {"update_info": {"names": names, "dtype_names": dtypes, "shapes": shapes}}


def push(on_every_server: OnEveryServer, broadcast_while: Callable[[str, dict], None],
         named: list[tuple[str, torch.Tensor]]) -> None:
    """One weight update: `broadcast_while(path, payload)` POSTs to every server while rank 0 broadcasts
    every tensor of `named`."""
    on_every_server("/pause", lambda index: {})
    on_every_server("/start_weight_update", lambda index: {"is_checkpoint_format": True})
    broadcast_while("/update_weights", update_payload(named))
    on_every_server("/finish_weight_update", lambda index: {})
    on_every_server("/resume", lambda index: {})
