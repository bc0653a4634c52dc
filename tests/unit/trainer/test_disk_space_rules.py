"""The disk-space check's arithmetic and its sources (trainer/disk_space.py), by hand."""

import errno
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from aligner_ext.errors import DiskSpaceError
from aligner_ext.files import attempt_write, failed_write
from aligner_ext.trainer import disk_space
from aligner_ext.trainer.disk_space import WriteEstimate, check_free_space, peak_count, planned_saves


def test_the_saves_of_a_run_are_every_save_every_steps_before_the_last_and_the_last():
    assert planned_saves(save_every=2, start_step=0, total_steps=5) == 3  # steps 2, 4 and the final 5
    assert planned_saves(save_every=2, start_step=0, total_steps=4) == 2  # step 2 and the final 4
    assert planned_saves(save_every=0, start_step=0, total_steps=4) == 1  # the final one alone
    assert planned_saves(save_every=1, start_step=3, total_steps=5) == 2  # resumed at 3: steps 4 and 5


def test_the_peak_counts_the_new_checkpoint_beside_the_kept_ones():
    assert peak_count(keep_last=2, existing=0, saves=5) == 3  # two kept and the one being written
    assert peak_count(keep_last=2, existing=0, saves=1) == 1
    assert peak_count(keep_last=0, existing=1, saves=4) == 5  # every one kept
    assert peak_count(keep_last=1, existing=4, saves=3) == 5  # the first save lands before the prune


def settings(keep_last: int = 2):
    return SimpleNamespace(trainer=SimpleNamespace(keep_last=keep_last))


def test_a_run_that_does_not_fit_names_both_numbers_and_what_to_change(tmp_path, monkeypatch):
    monkeypatch.setattr(disk_space, "free_space", lambda path: (3 * 2**30, ""))
    # 3 checkpoints of 1.5 GiB and an export of 0.5 GiB: 5 GiB, less the 1 GiB of one already there
    estimate = WriteEstimate(checkpoint=3 * 2**29, count=3, export=2**29, held=2**30)
    with pytest.raises(DiskSpaceError) as refused:
        check_free_space(settings(), tmp_path / "run", estimate)
    message = str(refused.value)
    assert "needs 4.0 GiB for 3 checkpoint(s) of about 1.5 GiB" in message and "has 3.0 GiB free" in message
    assert "trainer.keep_last (now 2" in message and "trainer.output_dir" in message
    assert "save_optimizer" not in message  # the estimate offered no weights-only size
    estimate.weights_only = 2**29
    with pytest.raises(DiskSpaceError) as refused:
        check_free_space(settings(), tmp_path / "run", estimate)
    assert "trainer.save_optimizer=false: checkpoints of about 512.00 MiB" in str(refused.value)
    assert check_free_space(settings(), tmp_path / "run", WriteEstimate(2**29, 3, 2**29, 0)) is not None  # 2 GiB fit


@pytest.mark.parametrize("fstype", ["nfs4", "fuse.sshfs", "lustre"])
def test_free_space_on_a_network_filesystem_is_unknown_and_said_once(tmp_path, monkeypatch, caplog, fstype):
    monkeypatch.setattr(disk_space, "filesystem_type", lambda path: fstype)
    free, why = disk_space.free_space(tmp_path)
    assert free is None and fstype in why
    with caplog.at_level(logging.WARNING):
        check_free_space(settings(), tmp_path, WriteEstimate(2**60, 3, 0, 0))  # would never fit: not refused
    assert len(caplog.records) == 1 and "cannot be known" in caplog.records[0].message


def test_the_filesystem_type_is_read_from_proc_mounts():
    assert disk_space.filesystem_type(Path("/proc/self")) == "proc"


def test_a_failed_write_is_told_from_a_bug():
    assert failed_write(OSError(errno.ENOSPC, "No space left on device")) is not None
    assert failed_write(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")) is not None
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = OSError(errno.EIO, "Input/output error")
    assert isinstance(failed_write(wrapped), OSError)
    assert failed_write(KeyError("step")) is None
    per_rank = CheckpointException("save failed", {1: (OSError(errno.ENOSPC, "No space left on device"), None)})
    assert isinstance(failed_write(per_rank), OSError)  # megatron-core's failure of rank 1
    elsewhere = CheckpointException("write", {})  # what megatron-core raises on the ranks that did not fail
    assert failed_write(elsewhere) is elsewhere

    def bug():
        raise KeyError("step")

    with pytest.raises(KeyError):
        attempt_write(bug)
