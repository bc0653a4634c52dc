"""Checkpoints saved in the background (`trainer.async_save`, trainer/checkpoint.py): the files hold the
moment `save` returned, whatever the next step changes while the writer runs, and equal a synchronous
save's; a background write that fails is the one-line failure at the next `wait`, the last good
checkpoint staying `latest`. The writer is held at an event the test sets, never timed."""

import errno
import threading

import pytest
import torch

from aligner_ext.errors import DiskSpaceError
from aligner_ext.trainer import checkpoint as checkpoint_module
from aligner_ext.trainer.checkpoint import Checkpointer, load_trainer_state
from test_checkpoint import assert_nested_equal, trained_one_step


@pytest.fixture
def gated_writer(monkeypatch):
    """The writer thread waits at `gate` (set it to let the write go on) after telling `reached`; the gate
    opens at the end of the test whatever happened, so no writer outlives it."""
    gate, reached = threading.Event(), threading.Event()
    real = checkpoint_module._write_from_memory

    def write(tmp, step, files):
        reached.set()
        gate.wait()
        real(tmp, step, files)

    monkeypatch.setattr(checkpoint_module, "_write_from_memory", write)
    yield gate, reached
    gate.set()


def files_of(path):
    return {str(file.relative_to(path)): file.read_bytes() for file in sorted(path.rglob("*")) if file.is_file()}


def test_a_background_save_holds_the_moment_it_started_and_equals_a_synchronous_one(tmp_path, tiny_model,
                                                                                    tiny_tokenizer, gated_writer):
    optimizer = trained_one_step(tiny_model)
    state = {"policy": {"optimizer": optimizer.state_dict()}, "loader": {"position": 3}}
    synchronous = Checkpointer(tmp_path / "sync", keep_last=0).save(1, tiny_model, tiny_tokenizer, state)

    background = Checkpointer(tmp_path / "background", keep_last=0)
    gate, reached = gated_writer
    final = background.save(1, tiny_model, tiny_tokenizer, state, background=True)
    assert reached.wait(timeout=120), "no writer thread started"  # the bound only ends a broken run
    assert not final.exists() and background.latest() is None  # returned before anything was written
    with torch.no_grad():  # the next step, while the writer waits: weights, optimizer moments, RNG
        for parameter in tiny_model.parameters():
            parameter.add_(1.0)
        for moments in optimizer.state.values():
            moments["exp_avg"].add_(1.0)
    torch.rand(5)
    gate.set()
    background.wait()

    assert background.latest() == final and (background.directory / "latest").read_text() == "step_1"
    background.verify(final)
    ours, theirs = files_of(final), files_of(synchronous)
    assert ours.keys() == theirs.keys()
    for name in ours:  # trainer_state.pt: torch names its zip folder after the file, "archive" for a buffer
        if name not in ("trainer_state.pt", "manifest.json"):
            assert ours[name] == theirs[name], name
    assert_nested_equal(load_trainer_state(final / "trainer_state.pt"),
                        load_trainer_state(synchronous / "trainer_state.pt"))


def test_a_background_write_that_fails_is_one_line_at_the_next_wait_and_keeps_the_last_checkpoint(
        tmp_path, tiny_model, tiny_tokenizer, monkeypatch):
    checkpointer = Checkpointer(tmp_path, keep_last=0)
    first = checkpointer.save(1, tiny_model, tiny_tokenizer, {"marker": 1}, background=True)
    checkpointer.wait()

    returned = threading.Event()

    def full_disk(tmp, step, files):
        returned.wait()
        (tmp / "trainer_state.pt").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "model.safetensors"))

    monkeypatch.setattr(checkpoint_module, "_write_from_memory", full_disk)
    second = checkpointer.save(2, tiny_model, tiny_tokenizer, {"marker": 2}, background=True)
    returned.set()
    with pytest.raises(DiskSpaceError) as failed:
        checkpointer.wait()
    message = str(failed.value)
    assert f"writing checkpoint {second} failed ([Errno 28] No space left on device" in message
    assert "latest still names step_1, which a rerun resumes from" in message and "\n" not in message
    assert sorted(path.name for path in checkpointer.directory.iterdir()) == ["latest", "step_1"]  # .step_2.tmp gone
    assert checkpointer.latest() == first
    checkpointer.verify(first)
    checkpointer.wait()  # the failure was reported once: nothing is under way any more


def test_a_bug_in_the_background_writer_keeps_its_traceback(tmp_path, tiny_model, tiny_tokenizer, monkeypatch):
    returned = threading.Event()

    def bug(tmp, step, files):
        returned.wait()
        raise KeyError("not a failed write")

    monkeypatch.setattr(checkpoint_module, "_write_from_memory", bug)
    checkpointer = Checkpointer(tmp_path, keep_last=0)
    checkpointer.save(1, tiny_model, tiny_tokenizer, {}, background=True)
    returned.set()
    with pytest.raises(KeyError, match="not a failed write"):
        checkpointer.wait()



def test_a_save_that_waits_for_the_previous_write_says_saves_outpace_the_disk_once(tmp_path, tiny_model,
                                                                                   tiny_tokenizer, monkeypatch, caplog):
    """The 8B run that found it (docs/benchmarks.md): a weights-only save every 2 steps of 8 s, written in 36 s.
    Each write waits for a token the test hands out, so a write is still under way when the next save comes;
    any wait for it counts here (threshold 0): the test waits on the writes, not on time."""
    monkeypatch.setattr(checkpoint_module, "BEHIND_THE_DISK_S", 0.0)
    tokens, real = threading.Semaphore(0), checkpoint_module._write_from_memory

    def write(tmp, step, files):
        tokens.acquire()
        real(tmp, step, files)

    monkeypatch.setattr(checkpoint_module, "_write_from_memory", write)
    checkpointer = Checkpointer(tmp_path, keep_last=0)
    with caplog.at_level("INFO", logger="aligner_ext.trainer.checkpoint"):
        for step in (1, 2, 3):
            if step > 1:
                tokens.release()  # the previous write goes on; this save waits for it
            checkpointer.save(step, tiny_model, tiny_tokenizer, {"marker": step}, background=True)
        tokens.release()
        checkpointer.wait()
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "checkpoint step_2 waited" in warnings[0] and "for step_1, still being written" in warnings[0]
    assert "raise trainer.save_every" in warnings[0]
    waited = [record.getMessage() for record in caplog.records if "the loop waited" in record.getMessage()]
    assert "of them" not in waited[0]
    assert "s of them for step_1's write" in waited[1] and "s of them for step_2's write" in waited[2]
    assert checkpointer.latest().name == "step_3"
