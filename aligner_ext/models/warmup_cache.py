"""The warmed-up embedded model, kept once per machine and warm-up.

A variant's demo spends most of a short run warming the embedded model up (200-600 supervised steps).
The result depends on the warm-up's inputs, so it is kept under the cache directory
(`model.warmup.cache_dir`) by a key hashing them: the model's size, the warm-up settings, every
(prompt, target) example and the device type. A run whose key is there copies the model into its
run directory instead of training it again; a run that trained one stores it. Entries are written
under a temporary name and renamed into place, so a killed run leaves no half entry.

The result's roundings also depend on the machine: the CPU's vector instructions (torch's kernels for
AVX-512 and for AVX2 round differently) and the thread count. The key leaves them out, so every later
run on a machine starts from the weights its first warm-up left, whatever its thread count; the
demo's held-out accuracy before RL differs by machine (docs/demo.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_ENV = "ALIGNER_EXT_CACHE"  # overrides the cache root that "auto" picks


def cache_root(setting: str) -> Path | None:
    """Where warmed models are kept: `setting` as a path, "auto" ($ALIGNER_EXT_CACHE, else
    $XDG_CACHE_HOME/aligner_ext, else ~/.cache/aligner_ext, + /warmup), or None for "none"."""
    if setting == "none":
        return None
    if setting != "auto":
        return Path(setting).expanduser()
    base = os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "aligner_ext"
    return Path(base) / "warmup"


def warmup_key(tiny, warmup, examples: list, device_type: str) -> str:
    """A hash of everything the warm-up's result depends on."""
    settings = {name: value for name, value in dataclasses.asdict(warmup).items() if name != "cache_dir"}
    text = json.dumps([dataclasses.asdict(tiny), settings, examples, device_type], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def fetch(root: Path | None, key: str, directory: Path) -> bool:
    """Copy the cached model `key` to `directory` (written whole or not at all); False if absent."""
    entry = None if root is None else root / key
    if entry is None or not (entry / "config.json").is_file():
        return False
    _copy_whole(entry, directory)
    logger.info("the embedded model's warm-up is cached: copied %s (model.warmup.cache_dir)", entry)
    return True


def store(root: Path | None, key: str, directory: Path) -> None:
    """Keep the warmed model in `directory` as cache entry `key` (a failure to write only warns)."""
    if root is None or (root / key / "config.json").is_file():
        return
    try:
        root.mkdir(parents=True, exist_ok=True)
        _copy_whole(directory, root / key)
    except OSError as err:
        logger.warning("could not keep the warmed model in %s: %s", root, err)


def _copy_whole(source: Path, destination: Path) -> None:
    """Copy a directory under a temporary name, then rename it into place."""
    tmp = destination.with_name(f".{destination.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    try:
        os.replace(tmp, destination)
    except OSError:  # another process put it there first: theirs is as good
        shutil.rmtree(tmp, ignore_errors=True)
        if not (destination / "config.json").is_file():
            raise
