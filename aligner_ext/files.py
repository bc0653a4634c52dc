"""File permissions of what a run writes.

Every file and directory of a run follows the process's umask, as files created with `open` do.
Some writers do not: safetensors creates its files 0600 whatever the umask, so a checkpoint's
weights would be unreadable to the group that can read the rest of it. `follow_umask` resets a
finished output tree to the modes the umask gives.
"""

from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def follow_umask(root: Path) -> None:
    """Give every file under `root` mode 0666 and every directory 0777, less the umask (root included)."""
    mask = current_umask()
    for path in [root, *root.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)
