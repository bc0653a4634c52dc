"""Whether a run's checkpoints fit on its disk: checked before step 1, and a save that fails anyway is
one line.

`check_free_space` (every process, before the first step) estimates what the run will write and
compares it with the free space of the output directory's filesystem:
- one checkpoint: the policy's estimate of its weights and optimizer state, every process together
  (`Policy.checkpoint_bytes`; the weights alone with `trainer.save_optimizer=false`), plus the
  tokenizer as `save_pretrained` writes it;
- how many at once: a new checkpoint is complete before the oldest is pruned, so at the peak
  `trainer.keep_last` + 1 of them (every one the run saves with keep_last=0), the checkpoints already
  in the directory of a resumed run included: those count at their size on disk, as space the run
  already holds (pruning frees it);
- the final export (`hf_model/`, `Policy.export_bytes`) with `trainer.export_hf`.
Short of space it refuses in one line (`DiskSpaceError`, exit 2) naming both numbers and what to
change. Where the free space cannot be known (a network or FUSE filesystem, whose free space is
shared with others or reported by a server; a failing statvfs) it says so once and the run goes on.

A save or export that fails while writing (`files.failed_write`: disk full, quota, an I/O error, as
Python, torch, safetensors or megatron-core report it) becomes `save_failed`'s one line naming the
path, the bytes it needs and the bytes free; the checkpointer has removed its temporary directory
and `latest` names the last good checkpoint. The run stops there (docs/reliability.md says why).
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from aligner_ext.config import RunConfig
from aligner_ext.distributed import is_main_process
from aligner_ext.errors import DiskSpaceError, error_line

if TYPE_CHECKING:
    from aligner_ext.models.base import Policy

logger = logging.getLogger(__name__)

# Filesystems whose free space says little about what this run may write (shared, or a server's word)
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "beegfs")


@dataclass
class WriteEstimate:
    """What a run writes at its peak: `count` checkpoints of about `checkpoint` bytes and the export."""

    checkpoint: int
    count: int
    export: int
    held: int  # bytes of the checkpoints already in the run directory, among the `count`
    weights_only: int = 0  # one checkpoint's bytes with trainer.save_optimizer=false, where the run saves the optimizer

    @property
    def needed(self) -> int:
        """Bytes beyond what the run directory already holds."""
        return max(self.count * self.checkpoint + self.export - self.held, 0)


def human(size: float) -> str:
    """`size` bytes as GiB from one GiB on, MiB below."""
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.2f} MiB"


def filesystem_type(path: Path) -> str:
    """The type of the filesystem `path` lies on, from /proc/mounts ("" where it cannot be read)."""
    try:
        mounts = [line.split() for line in Path("/proc/mounts").read_text().splitlines()]
    except OSError:
        return ""
    resolved = path.resolve()
    best, fstype = -1, ""
    for fields in mounts:
        mount_point = Path(fields[1].replace("\\040", " "))
        if (resolved == mount_point or mount_point in resolved.parents) and len(mount_point.parts) > best:
            best, fstype = len(mount_point.parts), fields[2]
    return fstype


def existing_parent(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (a fresh run's directory is made later)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_space(path: Path) -> tuple[int | None, str]:
    """(bytes free on `path`'s filesystem, "") or (None, why they cannot be known)."""
    where = existing_parent(path)
    fstype = filesystem_type(where)
    if fstype in NETWORK_FILESYSTEMS or fstype.startswith("fuse"):
        return None, f"a {fstype} filesystem, whose free space is shared or reported by a server"
    try:
        return shutil.disk_usage(where).free, ""
    except OSError as err:
        return None, f"statvfs failed: {err}"


def tokenizer_bytes(tokenizer) -> int:
    """Bytes of the tokenizer's files as `save_pretrained` writes them (every checkpoint and the export hold them)."""
    with tempfile.TemporaryDirectory() as directory:
        tokenizer.save_pretrained(directory)
        return sum(file.stat().st_size for file in Path(directory).rglob("*") if file.is_file())


def directory_bytes(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())


def planned_saves(save_every: int, start_step: int, total_steps: int) -> int:
    """Checkpoints the loop writes from `start_step` on: every `save_every` steps before the last, and the last."""
    periodic = [step for step in range(start_step + 1, total_steps) if save_every and step % save_every == 0]
    return len(periodic) + 1


def peak_count(keep_last: int, existing: int, saves: int) -> int:
    """Checkpoints on disk at the peak: the first save lands beside every existing one (pruning follows
    it), later saves beside `keep_last` of them; keep_last=0 keeps them all."""
    if keep_last <= 0:
        return existing + saves
    return max(existing + 1, min(keep_last + 1, existing + saves))


def estimate_writes(cfg: RunConfig, policy: Policy, tokenizer, existing: list[Path], start_step: int
                    ) -> WriteEstimate:
    """What the run will write (module docstring). Collective for a sharded policy."""
    tokenizer_size = tokenizer_bytes(tokenizer)
    saves = planned_saves(cfg.trainer.save_every, start_step, cfg.trainer.total_steps)
    optimizer = cfg.trainer.save_optimizer
    return WriteEstimate(
        checkpoint=policy.checkpoint_bytes(optimizer) + tokenizer_size,
        count=peak_count(cfg.trainer.keep_last, len(existing), saves),
        export=policy.export_bytes() + tokenizer_size if cfg.trainer.export_hf else 0,
        held=sum(directory_bytes(path) for path in existing),
        weights_only=policy.checkpoint_bytes(optimizer=False) + tokenizer_size if optimizer else 0,
    )


def check_free_space(cfg: RunConfig, run_dir: Path, estimate: WriteEstimate) -> WriteEstimate:
    """Refuse a run whose checkpoints and export cannot fit in the free space (every process; module
    docstring), or say once that the free space cannot be known; `estimate` when they fit."""
    free, unknown = free_space(run_dir)
    if free is None:
        if is_main_process():
            logger.warning("free space under %s cannot be known (%s): not checking that the run's %d checkpoint(s) "
                           "of about %s and its export fit", run_dir, unknown, estimate.count,
                           human(estimate.checkpoint))
        return estimate
    if estimate.needed <= free:
        if is_main_process():
            logger.info("disk: up to %d checkpoint(s) of about %s and an export of %s need %s; %s free under %s",
                        estimate.count, human(estimate.checkpoint), human(estimate.export), human(estimate.needed),
                        human(free), run_dir)
        return estimate
    held = f", beside the {human(estimate.held)} of the checkpoints already there" if estimate.held else ""
    export = f" and the export (hf_model/, {human(estimate.export)})" if estimate.export else ""
    weights_only = (f", save the weights alone (trainer.save_optimizer=false: checkpoints of about "
                    f"{human(estimate.weights_only)}, resumed with a fresh optimizer)" if estimate.weights_only else "")
    raise DiskSpaceError(
        f"{run_dir}: the run needs {human(estimate.needed)} for {estimate.count} checkpoint(s) of about "
        f"{human(estimate.checkpoint)}{export}{held}, and its filesystem has {human(free)} free: lower "
        f"trainer.keep_last (now {cfg.trainer.keep_last}; 0 keeps every checkpoint){weights_only}, choose another "
        "trainer.output_dir, or free or add disk space")


def save_failed(what: str, path: Path, needed: int, failure: BaseException, after: str) -> DiskSpaceError:
    """The one line for a failed write of `what` at `path` (`failure`: `files.failed_write`'s; `needed`: the
    estimated bytes; `after`: what stays and what to do), with the bytes free now."""
    free, _ = free_space(path)
    space = f"{human(free)} free" if free is not None else "free space unknown"
    return DiskSpaceError(f"writing {what} {path} failed ({error_line(failure)[:200]}); it needs about "
                          f"{human(needed)}, its filesystem has {space}; {after}")
