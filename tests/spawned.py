"""Two CPU processes (gloo) spawned for a test: each runs `worker(rank, directory)` and saves what it got with
`save_rank`; the test reads both back."""

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def init_rank(rank: int, directory: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank, world_size=2)


def save_rank(got: dict, rank: int, directory: str) -> None:
    torch.save(got, Path(directory) / f"rank{rank}.pt")
    dist.destroy_process_group()


def spawn_ranks(worker, directory: Path) -> list[dict]:
    """`worker(rank, directory)` in 2 spawned processes; what each saved, by rank."""
    mp.spawn(worker, args=(str(directory),), nprocs=2, join=True)
    return [torch.load(directory / f"rank{r}.pt", weights_only=False) for r in range(2)]
