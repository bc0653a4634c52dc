"""Overrides that shrink the embedded default job to a few seconds, shared by the end-to-end tests, and
`train_in_child`, which runs `aligner-ext train` in a child process, after a patch that may kill it.

Every run starts one compute thread: with `trainer.cpu_threads=0` a run takes the cores free when it
starts (aligner_ext/threads.py), so two runs of a test started at different moments of a busy machine
would sum floats in different orders, and a test comparing them would compare the machine's load."""

import os
import subprocess
import sys
from pathlib import Path

SMALL_MODEL = [
    "model.tiny.hidden_size=32", "model.tiny.num_layers=2", "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1",
    "model.tiny.intermediate_size=64", "model.warmup.steps=30", "model.warmup.batch_size=16",
    "data.builtin_train_size=64", "data.builtin_val_size=8", "data.train_batch_size=4", "data.val_batch_size=8",
    "rollout.n=4", "trainer.progress_bar=false", "reward.num_workers=1", "trainer.cpu_threads=1",
]


def train_in_child(overrides: list[str], patch: str = "") -> subprocess.CompletedProcess:
    """`aligner-ext train *overrides` in a child process that first runs `patch` (Python, which may call
    `kill()`: SIGKILL to the child itself, nothing after it runs), with this folder importable (the
    e2e rewards and environments, in the reward workers too)."""
    script = ("import os, signal, sys\n"
              "def kill():\n"
              "    os.kill(os.getpid(), signal.SIGKILL)\n"
              f"{patch}"
              "from aligner_ext.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    here = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", script, "train", *overrides], env=env, capture_output=True,
                          text=True, timeout=600)
