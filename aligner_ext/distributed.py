"""Which process of a multi-process run this is, and the few synchronisation points the trainer needs.

A run launched by torchrun (`torchrun --nproc_per_node=N -m aligner_ext train ...`) runs the same
loop in every process with the same seeds; a policy backend that shards the model (megatron) splits
its own work over the processes. Files are written by the main process (rank 0) only; the others
wait at a barrier where they must read what it wrote (the embedded model's warm-up output).
Work that every process could do on its own (generation, reward calls) is split by `map_split`:
each process takes a contiguous share of the items and the results are all-gathered, so every
process ends with the same full list and the loop stays replicated.

Decisions: the rank is read from torch.distributed once it is initialised, else from torchrun's
`RANK` variable, so `is_main_process` is right before any process group exists. `init_from_env`
creates the process group from torchrun's variables (NCCL on GPUs, this rank's GPU selected first;
gloo on CPU); a process without torchrun's variables is a world of one and every helper is a no-op.
"""

from __future__ import annotations

import os
import socket
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

Item = TypeVar("Item")
Result = TypeVar("Result")


def launched_world_size() -> int:
    """Processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's global rank (0 without torchrun)."""
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else launched_world_size()


def is_main_process() -> bool:
    """True in the process that writes the run's files."""
    return rank() == 0


def free_port() -> int:
    """A TCP port that is free on this machine right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_from_env() -> None:
    """Create the default process group from torchrun's variables, once; nothing in a world of one."""
    if dist.is_initialized() or "RANK" not in os.environ:
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl")
    else:
        dist.init_process_group(backend="gloo")


def barrier() -> None:
    """Wait for every process (no-op in a world of one)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def any_process(flag: bool) -> bool:
    """Whether `flag` is true on any process (collective; `flag` itself in a world of one)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    value = torch.tensor([int(flag)], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def fewest(value: int, group) -> int:
    """The smallest `value` of the ranks of `group`, a gloo group (collective)."""
    smallest = torch.tensor([value])
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=group)
    return int(smallest.item())


@contextmanager
def main_process_first() -> Iterator[None]:
    """The main process runs the block first; the others run it after it finished (and can read its files)."""
    if not is_main_process():
        barrier()
    try:
        yield
    finally:
        if is_main_process():
            barrier()


def share(count: int, rank_index: int, world: int) -> range:
    """The indices of the contiguous share of `count` items that rank `rank_index` of `world` takes.

    The first `count % world` ranks take one item more; with fewer items than ranks the last ranks take none.
    """
    base, extra = divmod(count, world)
    begin = rank_index * base + min(rank_index, extra)
    return range(begin, begin + base + (rank_index < extra))


def map_split(fn: Callable[[list[Item]], list[Result]], items: list[Item], group=None) -> list[Result]:
    """`fn` over this rank's `share` of `items`; every rank returns the results of all items, in order.

    `fn` maps a list to a list of the same length. Collective over `group` (default: every rank):
    each of its ranks must call it with the same number of items; ranks are numbered within it.
    Without a group of several ranks this is `fn(items)`. If `fn` raises on some rank, every rank
    raises (that rank its own exception, the others an error naming it) rather than waiting forever
    in the gather.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return fn(items)
    world, me = dist.get_world_size(group), dist.get_rank(group)
    mine = share(len(items), me, world)
    failure = None
    try:
        local = ("ok", fn(items[mine.start : mine.stop]))
    except Exception as err:  # re-raised below, after the other ranks have heard of it
        failure, local = err, ("error", f"{type(err).__name__}: {err}")
    parts: list = [None] * world
    dist.all_gather_object(parts, local, group=group)
    if failure is not None:
        raise failure
    failed = [f"rank {index}: {value}" for index, (status, value) in enumerate(parts) if status == "error"]
    if failed:
        raise RuntimeError(f"a split call failed on another rank ({'; '.join(failed)})")
    results = [result for _, values in parts for result in values]
    if len(results) != len(items):
        raise RuntimeError(f"a split call returned {len(results)} results for {len(items)} items")
    return results
