"""Reward workers end quietly however the pool goes away: the manager's end closed while a worker waits,
while it replies, or with its reply unread; a KeyboardInterrupt in the worker; Ctrl-C (ignored) and
SIGTERM. Each case runs in a fresh process whose forkserver, and so every worker, writes to a stderr
the test reads: no traceback may appear there, and each worker exits 0 (SIGTERM: by the signal)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).parent

SCRIPT = textwrap.dedent("""
    import json, os, pickle, signal
    from aligner_ext.data.types import PromptRow
    from aligner_ext.rewards.manager import RewardConfig, RewardManager, _WorkerPool
    import reward_helper_fns as fns

    def call(fn, **extra):
        row = PromptRow(row_id="r:0", messages=[{"role": "user", "content": "q"}], data_source="s", extra_info=extra)
        return pickle.dumps((fn, "one two", row))

    pool = _WorkerPool(6)
    pool.wait_started()
    idle, unread, replying, interrupted, keyboard, terminated = pool.workers
    unread.conn.send_bytes(call(fns.count_words))
    assert unread.conn.poll(30)  # its reply has arrived and is never read: the close resets its pipe
    replying.conn.send_bytes(call(fns.sleep_then_score, sleep_s=1.0))  # its reply meets a closed pipe
    os.kill(interrupted.process.pid, signal.SIGINT)
    interrupted.conn.send_bytes(call(fns.count_words))
    answered = pickle.loads(interrupted.conn.recv_bytes())[0]  # still serving after Ctrl-C
    keyboard.conn.send_bytes(call(fns.raise_keyboard_interrupt))
    try:
        keyboard.conn.recv_bytes()
        ended = False
    except EOFError:
        ended = True
    os.kill(terminated.process.pid, signal.SIGTERM)
    for worker in pool.workers:
        worker.conn.close()
        worker.process.join(10)
    codes = {name: worker.process.exitcode for name, worker in zip(
        ["idle", "unread", "replying", "interrupted", "keyboard", "terminated"], pool.workers)}

    manager = RewardManager(RewardConfig(sources={"s": "reward_helper_fns:count_words"}, num_workers=2))
    manager.score(["a b", "c"], [PromptRow(row_id=f"r:{i}", messages=[{"role": "user", "content": "q"}],
                                           data_source="s") for i in range(2)])
    closed = manager._pool.workers
    manager.close()
    codes["manager_close"] = [worker.process.exitcode for worker in closed]
    print(json.dumps({"codes": codes, "answered": answered, "keyboard_ended": ended}))
""")


def test_workers_end_quietly_whatever_closes_their_pipe():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["answered"] == "ok" and result["keyboard_ended"]
    assert result["codes"] == {"idle": 0, "unread": 0, "replying": 0, "interrupted": 0, "keyboard": 0,
                               "terminated": -15, "manager_close": [0, 0]}
