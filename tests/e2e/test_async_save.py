"""A checkpoint saved in the background (`trainer.async_save`, the default) does not hold training up, and
a run SIGKILLed while one is written resumes from the previous checkpoint.

The child run's writer thread stops for good in the middle of step_2 (the trainer state written, the
weights not); step 3 trains and is logged all the same, and only then is the process killed: a save
that held the step up would never have reached step 3's log. Nothing waits on time: the patch waits on
the event the writer sets when it stops (bounded, so a run where no writer ever starts fails instead of
hanging). The killed run leaves step_1, written in the background and renamed into place, as `latest`
and complete; the same command resumes from it and finishes."""

import json
import signal

import pytest

from aligner_ext.cli import main
from aligner_ext.trainer.checkpoint import Checkpointer
from small_run import SMALL_MODEL, train_in_child

pytestmark = pytest.mark.slow
OVERRIDES = SMALL_MODEL + ["rollout.max_response_length=12", "trainer.total_steps=3", "trainer.save_every=1",
                           "trainer.keep_last=0", "trainer.tensorboard=false", "trainer.run_name=run",
                           "+reward.sources.arithmetic=e2e_rewards.digit_fraction"]

# step_2's writer stops after the trainer state; step 3's log kills the process once the writer has stopped
WRITER_STOPS_AT_STEP_2 = """
import threading
import aligner_ext.trainer.checkpoint as c
from aligner_ext.trainer.metrics import MetricsLogger
stopped = threading.Event()
real_write, real_log = c._write_from_memory, MetricsLogger.log
def write(tmp, step, files):
    if step == 2:
        (tmp / c.STATE_FILE).write_bytes(files[c.STATE_FILE])
        stopped.set()
        threading.Event().wait()
    real_write(tmp, step, files)
def log(self, step, metrics):
    real_log(self, step, metrics)
    if step == 3:
        if not stopped.wait(timeout=120):
            sys.exit(3)
        kill()
c._write_from_memory = write
MetricsLogger.log = log
"""


def test_a_run_killed_while_a_checkpoint_is_written_in_the_background_resumes_from_the_previous_one(tmp_path,
                                                                                                    caplog):
    killed = train_in_child([*OVERRIDES, f"trainer.output_dir={tmp_path}"], WRITER_STOPS_AT_STEP_2)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    run = tmp_path / "run"
    logged = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1] == 3  # step 3 trained while step_2's write could not finish
    checkpoints = run / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) == [".step_2.tmp", "latest", "step_1"]
    assert [path.name for path in (checkpoints / ".step_2.tmp").iterdir()] == ["trainer_state.pt"]
    assert (checkpoints / "latest").read_text() == "step_1"
    Checkpointer(run, keep_last=0).verify(checkpoints / "step_1")

    caplog.set_level("INFO")
    assert main(["train", *OVERRIDES, f"trainer.output_dir={tmp_path}"]) == 0
    assert "resumed from" in caplog.text and "step_1 (step 1)" in caplog.text
    assert sorted(path.name for path in checkpoints.iterdir()) == ["latest", "step_1", "step_2", "step_3"]
    assert (checkpoints / "latest").read_text() == "step_3"
    for step in (2, 3):
        Checkpointer(run, keep_last=0).verify(checkpoints / f"step_{step}")
