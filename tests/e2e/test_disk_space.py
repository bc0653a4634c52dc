"""A disk too small for the run: refused before step 1 in one line; a disk that fills during the run:
the failing save is one line, the last good checkpoint stays `latest` and verifies, and a rerun with
space resumes from it. Each case runs on a real small tmpfs (mounted here, skipped where mounting is
not permitted) and with the failure injected (no mount needed)."""

import errno
import json
import shutil
import subprocess
from collections import namedtuple
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoModelForCausalLM

import aligner_ext.trainer.checkpoint as checkpoint_module
from aligner_ext.cli import main
from aligner_ext.config import load_config
from aligner_ext.models.hf import HFPolicy
from aligner_ext.trainer.build import build_components
from aligner_ext.trainer.checkpoint import Checkpointer
from aligner_ext.trainer.disk_space import directory_bytes, estimate_writes
from small_run import SMALL_MODEL

pytestmark = pytest.mark.slow

OVERRIDES = SMALL_MODEL + ["rollout.max_response_length=12", "trainer.tensorboard=false", "trainer.keep_last=0",
                           "trainer.run_name=r"]
DiskUsage = namedtuple("DiskUsage", "total used free")


@pytest.fixture
def small_disk(tmp_path, request):
    """A tmpfs of `request.param` (a mount size such as 256k) at tmp_path/disk, unmounted after the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={request.param}", "tmpfs", str(disk)],
                                 capture_output=True, text=True)
        refusal = mounted.stderr.strip() or "mount failed" if mounted.returncode else ""
    except OSError as err:  # no mount command
        refusal = str(err)
    if refusal:
        pytest.skip(f"cannot mount a tmpfs here ({refusal}): the injected variants of these tests cover the behaviour")
    yield disk
    subprocess.run(["umount", "--lazy", str(disk)], check=True)  # a log handler of the run may hold a file open


def train(output_dir: Path, *overrides: str) -> None:
    assert main(["train", *OVERRIDES, f"trainer.output_dir={output_dir}", *overrides]) == 0


def one_line_error(capsys, output_dir: Path, *overrides: str) -> str:
    with pytest.raises(SystemExit) as stopped:
        main(["train", *OVERRIDES, f"trainer.output_dir={output_dir}", *overrides])
    assert stopped.value.code == 2
    stderr = capsys.readouterr().err
    error = stderr.rstrip("\n").split("\n")[-1]
    assert error.startswith("aligner-ext: error: ") and "Traceback" not in stderr
    return error


def assert_nothing_trained(run: Path) -> None:
    """The refusal came before step 1: no checkpoint, no metrics, no export."""
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()
    assert not (run / "hf_model").exists()


@pytest.mark.parametrize("small_disk", ["256k"], indirect=True)
def test_a_disk_too_small_for_one_checkpoint_is_refused_before_step_1(small_disk, capsys):
    # one checkpoint of the tiny model is about 300 KB (weights 88 KB, AdamW's moments twice that)
    error = one_line_error(capsys, small_disk, "trainer.total_steps=2")
    assert f"{small_disk / 'r'}: the run needs" in error and "free" in error
    assert "MiB" in error and "trainer.keep_last" in error and "trainer.output_dir" in error
    assert_nothing_trained(small_disk / "r")


def test_checkpoints_that_cannot_fit_are_refused_naming_both_numbers(tmp_path, capsys, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(real(path).total, 0, 2**20))  # 1 MiB free
    # keep_last=0 and a save every step: 5 checkpoints of about 0.25 MiB and the export do not fit in 1 MiB
    error = one_line_error(capsys, tmp_path, "trainer.total_steps=5", "trainer.save_every=1")
    assert "for 5 checkpoint(s) of about 0.25 MiB" in error and "has 1.00 MiB free" in error
    assert_nothing_trained(tmp_path / "r")
    train(tmp_path, "trainer.total_steps=5", "trainer.save_every=1", "trainer.keep_last=2")  # 3 at most: they fit


def fill(disk: Path) -> None:
    """Write into `disk` until it is full."""
    with open(disk / "filler", "wb") as handle:
        try:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        except OSError as err:
            assert err.errno == errno.ENOSPC


def fail_after_the_first_checkpoint(monkeypatch, then) -> None:
    """Run `then()` once step_1 is published (the disk fills, or writes start failing)."""
    real = Checkpointer._publish

    def publish(self, tmp, final):
        real(self, tmp, final)
        if final.name == "step_1":
            then()

    monkeypatch.setattr(Checkpointer, "_publish", publish)


def assert_first_checkpoint_kept(run: Path) -> None:
    checkpoints = run / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) == ["latest", "step_1"]  # .step_2.tmp removed
    assert (checkpoints / "latest").read_text() == "step_1"
    Checkpointer(run, keep_last=0).verify(checkpoints / "step_1")


def assert_resumed_and_finished(run: Path, caplog) -> None:
    assert "resumed from" in caplog.text and "step_1 (step 1)" in caplog.text
    assert (run / "checkpoints" / "latest").read_text() == "step_3"
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
    assert (run / "hf_model" / "config.json").is_file()


@pytest.mark.parametrize("small_disk", ["2m"], indirect=True)
def test_a_disk_that_fills_after_the_first_checkpoint(small_disk, capsys, caplog, monkeypatch):
    fail_after_the_first_checkpoint(monkeypatch, lambda: fill(small_disk))
    # saved in the foreground: in the background the full disk could fail step 3's metrics line before
    # the failed save is heard of (a background write's failure: tests/unit/trainer/test_background_checkpoint.py)
    error = one_line_error(capsys, small_disk, "trainer.total_steps=3", "trainer.save_every=1",
                           "trainer.async_save=false")
    assert f"writing checkpoint {small_disk / 'r' / 'checkpoints' / 'step_2'} failed" in error
    assert "it needs about 0.25 MiB" in error and "free" in error and "still names step_1" in error
    assert_first_checkpoint_kept(small_disk / "r")

    monkeypatch.undo()
    (small_disk / "filler").unlink()
    caplog.set_level("INFO")
    train(small_disk, "trainer.total_steps=3", "trainer.save_every=1")
    assert_resumed_and_finished(small_disk / "r", caplog)


def test_a_save_that_fails_with_enospc_keeps_the_last_checkpoint(tmp_path, capsys, caplog, monkeypatch):
    real = checkpoint_module.save_weights

    def full_disk(model, path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    fail_after_the_first_checkpoint(monkeypatch, lambda: monkeypatch.setattr(checkpoint_module, "save_weights",
                                                                             full_disk))
    # the foreground writer's weights (in the background: tests/unit/trainer/test_background_checkpoint.py)
    error = one_line_error(capsys, tmp_path, "trainer.total_steps=3", "trainer.save_every=1",
                           "trainer.async_save=false")
    assert f"writing checkpoint {tmp_path / 'r' / 'checkpoints' / 'step_2'} failed ([Errno 28] No space left" in error
    assert "still names step_1" in error
    assert_first_checkpoint_kept(tmp_path / "r")

    monkeypatch.undo()
    assert checkpoint_module.save_weights is real
    caplog.set_level("INFO")
    train(tmp_path, "trainer.total_steps=3", "trainer.save_every=1")
    assert_resumed_and_finished(tmp_path / "r", caplog)


def test_a_failing_export_is_one_line_and_the_rerun_exports(tmp_path, capsys, monkeypatch):
    def full_disk(policy, directory):
        Path(directory).mkdir()
        (Path(directory) / "config.json").write_text("{}")  # a partial export must not look like one
        raise OSError(errno.ENOSPC, "No space left on device", directory)

    monkeypatch.setattr(HFPolicy, "save_pretrained", full_disk)
    error = one_line_error(capsys, tmp_path, "trainer.total_steps=1")
    assert f"writing the export {tmp_path / 'r' / 'hf_model'} failed" in error
    assert "the final checkpoint is saved" in error
    assert not (tmp_path / "r" / "hf_model").exists()
    assert (tmp_path / "r" / "checkpoints" / "latest").read_text() == "step_1"

    monkeypatch.undo()
    train(tmp_path, "trainer.total_steps=1")
    assert (tmp_path / "r" / "hf_model" / "config.json").is_file()


def test_the_estimate_is_near_a_written_checkpoint_and_the_parameter_count(tmp_path):
    train(tmp_path, "trainer.total_steps=1")
    run = tmp_path / "r"
    cfg = load_config("base", [*OVERRIDES, f"trainer.output_dir={tmp_path}", "trainer.total_steps=1"])
    parts = build_components(cfg, run)
    estimate = estimate_writes(cfg, parts.policy, parts.tokenizer, existing=[], start_step=0)

    # float32 weights and AdamW's two float32 moments: 12 bytes per parameter, counted by transformers
    hf_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(run / "hf_model"))
    parameters = sum(param.numel() for param in hf_model.parameters())
    assert parts.policy.checkpoint_bytes() == 12 * parameters
    assert parts.policy.export_bytes() == 4 * parameters
    written = directory_bytes(run / "checkpoints" / "step_1")
    assert 0.8 * written <= estimate.checkpoint <= 1.2 * written
    assert 0.8 * directory_bytes(run / "hf_model") <= estimate.export <= 1.2 * directory_bytes(run / "hf_model")
    assert estimate.count == 1
