"""Reward workers end with their trainer: a SIGKILLed trainer whose reward call hangs leaves no worker
spinning behind it (a closed pool's workers exiting cleanly: test_reward_worker_shutdown.py)."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

HERE = Path(__file__).parent

# A trainer: starts the pool with a quick call, optionally forks a child that keeps every inherited fd
# open (the forkserver's pipe from the trainer included, so the forkserver outlives the trainer), then
# hangs in a reward call that spins forever (argv[3]: the reward function).
TRAINER = textwrap.dedent("""
    import os, sys, time
    from aligner_ext.data.types import PromptRow
    from aligner_ext.rewards.manager import RewardConfig, RewardManager

    out, hold, spin = sys.argv[1], sys.argv[2] == "hold", sys.argv[3]
    def row(source, **extra):
        return PromptRow(row_id="r:0", messages=[{"role": "user", "content": "q"}], data_source=source, extra_info=extra)
    manager = RewardManager(RewardConfig(sources={"spin": "reward_helper_fns:" + spin,
                                                  "count": "reward_helper_fns:count_words"},
                                         timeout_s=600, num_workers=1))
    manager.score(["one"], [row("count")])
    if hold and os.fork() == 0:
        time.sleep(120)
        os._exit(0)
    manager.score(["x"], [row("spin", pid_file=os.path.join(out, "worker.pid"))])
""")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# The parent-death signal covers the first and the last (the forkserver exits with the trainer; a C loop
# holding the GIL stops no signal); the watchdog thread on the trainer's pidfd the first two. A C loop in
# a worker whose forkserver outlives the trainer is covered by neither (docs/reliability.md).
@pytest.mark.parametrize("hold,spin", [("plain", "spin_forever"), ("hold", "spin_forever"),
                                       ("plain", "spin_forever_in_c")],
                         ids=["python-loop", "python-loop-forkserver-held-open", "c-loop-holding-the-gil"])
def test_workers_die_within_seconds_of_a_sigkilled_trainer(tmp_path, hold, spin):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(tmp_path), hold, spin], env=env)
    pid_file = tmp_path / "worker.pid"
    holders = []
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text()):
            assert trainer.poll() is None and time.monotonic() < deadline, "the reward call never started"
            time.sleep(0.1)
        worker = int(pid_file.read_text())
        holders = [child for child in psutil.Process(trainer.pid).children() if child.pid != worker
                   and "forkserver" not in " ".join(child.cmdline())]
        assert not gone(worker)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        deadline = time.monotonic() + 5
        while not gone(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(worker), "the reward worker outlived its SIGKILLed trainer"
    finally:
        for process in [*holders, *([psutil.Process(worker)] if not gone(worker) else [])]:
            process.kill()
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()

