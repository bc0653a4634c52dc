"""User-style reward functions for the manager tests, loaded by dotted path 'reward_helper_fns:<name>'.

The test adds this folder to sys.path before the manager starts its workers, as a user would put
their own module on the path; workers inherit the trainer's sys.path.
"""

import itertools
import os
import time
from pathlib import Path

from aligner_ext.rewards.base import RewardResult


def count_words(response, row):
    """A plain float: the number of words."""
    return float(len(response.split()))


def worker_pid(response, row):
    """The pid of the process that ran the call, as the score."""
    return RewardResult(score=float(os.getpid()))


def raise_error(response, row):
    raise ValueError("cannot score this row")


def return_text(response, row):
    return "1.0"


def return_nan(response, row):
    return float("nan")


def exit_worker(response, row):
    os._exit(3)


def raise_keyboard_interrupt(response, row):
    """What a SIGINT handler that some library installs would raise in the worker."""
    raise KeyboardInterrupt


def sleep_then_score(response, row):
    """Sleep `extra_info['sleep_s']` seconds (after writing this process's pid to `extra_info['pid_file']`)."""
    if "pid_file" in row.extra_info:
        Path(row.extra_info["pid_file"]).write_text(str(os.getpid()))
    time.sleep(row.extra_info["sleep_s"])
    return 1.0


def touch_marker(response, row):
    """Create the file `extra_info['marker']`: proof that the call ran."""
    Path(row.extra_info["marker"]).touch()
    return 1.0


def return_beyond_float32(response, row):
    """Finite in Python, infinite once the batch turns rewards into float32."""
    return 1e39


def spin_forever(response, row):
    """Write this process's pid to `extra_info['pid_file']`, then hang at 100% CPU: a reward call that never ends."""
    Path(row.extra_info["pid_file"]).write_text(str(os.getpid()))
    while True:
        pass


def spin_forever_in_c(response, row):
    """As spin_forever, but the loop is C code holding the GIL, so no other thread of the worker ever runs."""
    Path(row.extra_info["pid_file"]).write_text(str(os.getpid()))
    return float(sum(itertools.repeat(1)))


def verl_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A verl-style reward function (verl's signature and dict result), used unchanged."""
    right = solution_str.strip().endswith(str(ground_truth))
    return {"score": 1.0 if right else -1.0, "acc": right, "pid": os.getpid()}


def torch_threads(response, row):
    """The worker's torch intra-op threads, and its OMP_NUM_THREADS."""
    import torch

    return RewardResult(score=float(torch.get_num_threads()), info={"omp": os.environ.get("OMP_NUM_THREADS")})
