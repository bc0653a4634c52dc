"""Fault injection: the newest checkpoint of a run is corrupted on disk (one byte of its weights
flipped). The resume names the damaged file, falls back to the previous complete checkpoint,
trains the lost step again and leaves a checkpoint that verifies."""

import json
import logging

import pytest

from aligner_ext.cli import main
from aligner_ext.trainer.checkpoint import Checkpointer
from small_run import SMALL_MODEL

pytestmark = pytest.mark.slow


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog):
    overrides = SMALL_MODEL + ["trainer.total_steps=3", "trainer.save_every=1", "trainer.keep_last=0",
                               "trainer.tensorboard=false", f"trainer.output_dir={tmp_path}", "trainer.run_name=r"]
    assert main(["train", *overrides]) == 0
    run = tmp_path / "r"
    weights = run / "checkpoints" / "step_3" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0xFF  # inside the last tensor's values: the file still parses, its numbers are wrong
    weights.write_bytes(bytes(data))
    (run / "summary.json").unlink()  # killed after saving step 3, before it finished (a finished run is not rerun)

    with caplog.at_level(logging.INFO):
        assert main(["train", *overrides]) == 0
    assert f"{weights}: its SHA-256 differs from the manifest's" in caplog.text
    assert "resumed from" in caplog.text and "step_2 (step 2)" in caplog.text
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]  # step 3 trained again, logged once
    checkpointer = Checkpointer(run, keep_last=0)
    assert checkpointer.latest() == run / "checkpoints" / "step_3"
    checkpointer.verify(checkpointer.latest())  # the re-saved step 3 is whole
