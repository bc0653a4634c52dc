"""What every benchmark of this folder shares: the record of where and what was measured (date,
machine, GPU, commit, command), the events that explain a slow step (compilations, garbage
collections, the allocator's retries and fresh device memory, new Triton kernels), the steps that
took more than SLOW x the median, and an earlier commit's tree for a before / after in one call.
"""

from __future__ import annotations

import datetime
import gc
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SLOW = 1.3  # a step above SLOW x the median of its series is flagged


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def commit() -> str:
    """This tree's commit, "+ local changes" when tracked files differ from it (the GPU machine's
    copy of the tree carries .git too)."""
    head = _git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (" + local changes" if _git("status", "--porcelain", "--untracked-files=no") else "")


def environment(argv: list[str]) -> dict:
    """Where and what: date (UTC), machine, GPU and driver, library versions, commit, command."""
    import torch
    import transformers

    env = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": f"{platform.machine()}, {os.cpu_count()} cores", "commit": commit(),
           "command": "python scripts/bench/run.py " + " ".join(argv),
           "torch": torch.__version__, "transformers": transformers.__version__, "gpu": None}
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        env["gpu"] = f"{f'{count} x ' if count > 1 else ''}{torch.cuda.get_device_name()} (driver {driver_version()})"
    return env


def driver_version() -> str:
    """The NVIDIA driver's version (nvidia-smi answers one line per GPU: the first)."""
    answer = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout
    return (answer.splitlines() or [""])[0].strip()


def device_times(fn, repeats: int, device: str) -> list[float]:
    """Wall seconds of each of `repeats` calls of `fn`, the device's queue drained before and after each."""
    import torch

    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def slow_steps(times: list[float]) -> list[int]:
    """Indices of the steps above SLOW x the median of `times`."""
    if len(times) < 3:
        return []
    median = statistics.median(times)
    return [index for index, seconds in enumerate(times) if seconds > SLOW * median]


def steps_line(name: str, records: list[dict], key: str = "step_s") -> str:
    """Every step's time, a slow one starred with the events of its step (StepEvents)."""
    times = [record[key] for record in records]
    slow = set(slow_steps(times))
    cells = [f"{seconds:.2f}" + ("*" if index in slow else "") for index, seconds in enumerate(times)]
    line = f"{name}: " + " ".join(cells)
    for index in sorted(slow):
        events = {k: v for k, v in records[index].get("events", {}).items() if v}
        line += f"; step {index} ({times[index]:.2f} s > {SLOW} x median): {events or 'no event recorded'}"
    return line


class StepEvents:
    """Counts, per step, what makes one step slower than its neighbours: torch.compile's compilations
    and their time, Python's garbage collections and their time, the CUDA caching allocator's retries
    (a cache flush and a new cudaMalloc when memory ran short) and fresh device allocations, and the
    Triton kernels compiled (new entries of the Triton cache folder)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.gc_s, self.gc_collections, self._gc_started = 0.0, 0, 0.0
        gc.callbacks.append(self._on_gc)
        self.last = self._snapshot()

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif info["generation"] == 2:  # the full collections; the young ones take microseconds
            self.gc_s += time.perf_counter() - self._gc_started
            self.gc_collections += 1

    @staticmethod
    def _triton_kernels() -> int:
        folder = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
        return sum(1 for _ in folder.iterdir()) if folder.is_dir() else 0

    def _snapshot(self) -> dict:
        snapshot = {"gc_collections": self.gc_collections, "gc_s": self.gc_s, "triton_kernels": self._triton_kernels()}
        if "torch._dynamo" in sys.modules:
            from torch._dynamo.utils import compilation_time_metrics, counters

            snapshot["compiled_graphs"] = counters["stats"]["unique_graphs"]
            snapshot["compile_s"] = sum(sum(times) for name, times in compilation_time_metrics.items()
                                        if name.endswith("compile_inner"))
        if self.cuda:
            import torch

            stats = torch.cuda.memory_stats()
            snapshot["alloc_retries"] = stats.get("num_alloc_retries", 0)
            snapshot["device_mallocs"] = stats.get("num_device_alloc", 0)
        return snapshot

    def take(self) -> dict:
        """What happened since the last call (rounded), e.g. {"compiled_graphs": 1, "compile_s": 1.9, ...}."""
        now = self._snapshot()
        delta = {key: now[key] - self.last.get(key, 0) for key in now}
        self.last = now
        return {key: round(value, 3) if isinstance(value, float) else value for key, value in delta.items()}


def prev_tree(spec: str) -> Path:
    """--prev: a folder (an earlier commit's tree, copied where the history is not) or a commit, whose
    tree `git archive` writes under bench_out/prev_<commit>."""
    if Path(spec).is_dir():
        return Path(spec).resolve()
    name = _git("rev-parse", "--short", spec)
    if not name:
        sys.exit(f"--prev {spec}: neither a folder nor a commit of this repository")
    tree = ROOT / "bench_out" / f"prev_{name}"
    if not tree.is_dir():
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", name], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree
