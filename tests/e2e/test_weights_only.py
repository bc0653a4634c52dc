"""Weights-only checkpoints (`trainer.save_optimizer=false`): the checkpoint holds the weights without
AdamW's moments; resuming it asks for the same setting, since the optimizer then starts afresh: the default (exact
resume) is refused in one line naming the checkpoint and both ways on, and `save_optimizer=false`
resumes it with a warning and finishes."""

import pytest

from aligner_ext.cli import main
from aligner_ext.trainer.checkpoint import load_trainer_state
from small_run import SMALL_MODEL

pytestmark = pytest.mark.slow
OVERRIDES = SMALL_MODEL + ["rollout.max_response_length=12", "trainer.tensorboard=false", "trainer.run_name=r",
                           "trainer.keep_last=0"]


def train(output_dir, *overrides):
    return main(["train", *OVERRIDES, f"trainer.output_dir={output_dir}", *overrides])


def test_a_weights_only_checkpoint_holds_no_optimizer_and_resumes_with_a_fresh_one(tmp_path, caplog):
    assert train(tmp_path, "trainer.total_steps=1", "trainer.save_optimizer=false") == 0
    step_1 = tmp_path / "r" / "checkpoints" / "step_1"
    state = load_trainer_state(step_1 / "trainer_state.pt")
    assert state["weights_only"] is True
    assert sorted(state["policy"]) == ["nonfinite_guard", "scheduler", "version"]  # no optimizer
    # AdamW's two moments would make trainer_state.pt about twice model.safetensors
    assert (step_1 / "trainer_state.pt").stat().st_size < 0.5 * (step_1 / "model.safetensors").stat().st_size

    caplog.set_level("INFO")
    assert train(tmp_path, "trainer.total_steps=2", "trainer.save_optimizer=false") == 0
    assert "step_1 (step 1)" in caplog.text and "a weights-only checkpoint: the optimizer's moments" in caplog.text
    assert (tmp_path / "r" / "checkpoints" / "latest").read_text() == "step_2"
