"""File permissions of what a run writes, and what a failed write looks like.

Every file and directory of a run follows the process's umask, as files created with `open` do.
Some writers do not: safetensors creates its files 0600 whatever the umask, so a checkpoint's
weights would be unreadable to the group that can read the rest of it. `follow_umask` resets a
finished output tree to the modes the umask gives.

`attempt_write` tells a failed write (disk full, quota, an I/O error) from a bug: the checkpointer and
the export turn the first into one line (trainer/disk_space.py), the second keeps its traceback.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

# How torch's writer, safetensors and megatron-core word a failed write that is not an OSError
WRITE_FAILURE_WORDS = ("no space left", "os error 28", "storagefull", "disk quota", "file write failed",
                       "unexpected pos", "iostream error", "input/output error")


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def follow_umask(root: Path) -> None:
    """Give every file under `root` mode 0666 and every directory 0777, less the umask (root included)."""
    mask = current_umask()
    for path in [root, *root.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def failed_write(err: BaseException) -> BaseException | None:
    """The failed write `err` is or wraps (its cause, megatron-core's per-rank failures): an OSError, or
    torch's, safetensors' or megatron-core's words for one; None when it is no failed write (a bug)."""
    seen, pending = set(), [err]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        failures = getattr(current, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        if isinstance(failures, dict):
            if not failures:  # megatron-core names the failure on rank 0 alone: a write failed there
                return current
            pending.extend(failure[0] if isinstance(failure, tuple) else failure for failure in failures.values())
            continue
        if isinstance(current, OSError) or any(word in str(current).lower() for word in WRITE_FAILURE_WORDS):
            return current
        pending.extend([current.__cause__, current.__context__])
    return None


def attempt_write(write: Callable[[], None]) -> BaseException | None:
    """Run `write`; the failed write it raised (`failed_write`), or None. Anything else is raised as it
    is: a bug keeps its traceback."""
    try:
        write()
    except BaseException as err:  # megatron-core's CheckpointException derives from BaseException
        failure = failed_write(err)
        if failure is None:
            raise
        return failure
    return None
