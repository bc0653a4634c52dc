"""The expert-parallel benchmark (scripts/bench/moe_ep_gpus.py) at the tiny size on the CPU (2
processes, gloo, float32): `aligner-ext train` on the Megatron backend at EP=2 with the rollout engine
exchanging tokens between the ranks' experts runs its steps, and the engine's log-probs are the
trainer's to float32 rounding (an engine that computed other experts would differ by order 1)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_two_steps_at_expert_parallel_2_agree_with_the_trainer(tmp_path):
    command = [sys.executable, str(ROOT / "scripts" / "bench" / "moe_ep_gpus.py"), "--tiny", "--runs", "ep2",
               "--steps", "2", "--out", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    run = json.loads((tmp_path / "moe_ep.json").read_text())["runs"]["ep2"]
    assert run["steps"] == 2
    assert run["rollout/logprob_diff_max"] < 1e-4
    assert run["moe/routing_mismatch"] is not None and run["moe/load_max"] >= 1.0
