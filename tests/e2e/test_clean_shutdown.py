"""A run's reward workers shut down without a word: a short run through the command line, plain GRPO and
MTPO (whose two rounds score twice a step), leaves no traceback on stderr, from the trainer or from any
reward worker (they write to the same stderr). The worker loop's own cases: tests/unit/rewards/
test_reward_worker_shutdown.py."""

import os
import subprocess
import sys

import pytest

from small_run import SMALL_MODEL

pytestmark = pytest.mark.slow

VARIANTS = {"plain": [], "mtpo": ["+variant=mtpo", "rollout.n=8"]}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_run_ends_without_a_traceback_from_its_reward_workers(tmp_path, variant):
    command = [sys.executable, "-m", "aligner_ext", "train", *SMALL_MODEL, *VARIANTS[variant],
               "reward.num_workers=2", "trainer.total_steps=2", "trainer.tensorboard=false",
               "trainer.export_hf=false", f"trainer.output_dir={tmp_path}", "trainer.run_name=run"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "run" / "summary.json").exists()
    for marker in ("Traceback", "ConnectionResetError", "BrokenPipeError", "EOFError", "Process reward-worker"):
        assert marker not in done.stderr, done.stderr[-4000:]
