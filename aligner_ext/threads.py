"""How many compute threads a run's process starts.

torch starts one intra-op thread per core by default, and its threads spin while they wait for each
other. On a machine where another process keeps a core busy, a thread that loses its core holds up
every parallel region: on 2 cores with one busy process beside it, the demo's step took 8.1 s with 2
threads against 1.4 s with one (0.54 s quiet; docs/demo.md). So a run starts as many threads as
there are cores free for it when it starts: the cores it may use (its CPU affinity) less those another
process keeps busy (sampled for a moment), shared among the processes torchrun starts on the machine.
`trainer.cpu_threads` sets the number instead. Reward workers compute with one thread each
(rewards/manager.py); they score while the trainer waits for them.
"""

from __future__ import annotations

import os

BUSY_PERCENT = 50.0  # a core busier than this, sampled over BUSY_SAMPLE_S, is taken by another process
BUSY_SAMPLE_S = 0.3


def usable_cores() -> int:
    """The cores this process may run on (its affinity), or all of the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def busy_cores() -> int:
    """Cores of this process's affinity that another process keeps busy right now (0 without psutil)."""
    try:
        import psutil
    except ImportError:
        return 0
    load = psutil.cpu_percent(interval=BUSY_SAMPLE_S, percpu=True)
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(len(load))
    return sum(1 for cpu in allowed if cpu < len(load) and load[cpu] > BUSY_PERCENT)


def compute_threads(setting: int) -> int:
    """Threads for this process: `setting` if given, else the free cores (module docstring). Under
    torchrun the machine's processes start together and would see each other as load, so they split
    the usable cores without sampling."""
    if setting:
        return setting
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_processes > 1:
        return max(1, usable_cores() // local_processes)
    return max(1, usable_cores() - busy_cores())
