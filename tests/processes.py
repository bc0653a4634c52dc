"""Processes a test starts: two spawned CPU processes (gloo), each running `worker(rank, directory)` and
saving what it got with `save_rank` for the test to read back; or a torchrun launch."""

import os
import signal
import subprocess
import sys
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


def torchrun(args: list[str], processes: int = 2, timeout: int = 300, pythonpath: tuple[str, ...] = ()) -> None:
    """`python -m torch.distributed.run --nproc_per_node=<processes> <args>` on a free port, one OpenMP
    thread per process; fails the test with the end of its output if it exits non-zero. Past `timeout`
    the launcher and its workers are killed together (their own process group), so a timed-out launch
    leaves no worker behind to slow the tests after it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([*pythonpath, os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={processes}",
               "--standalone", *args]
    launcher = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    try:
        stdout, stderr = launcher.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(launcher.pid, signal.SIGKILL)
        stdout, stderr = launcher.communicate()
        raise AssertionError(f"torchrun {args} ran past {timeout} s:\n{stdout[-3000:]}{stderr[-6000:]}") from None
    assert launcher.returncode == 0, stdout[-3000:] + stderr[-6000:]
