"""The save-stall benchmark (`run.py save-stall`, scripts/bench/save_stall.py): what it reads from a run and
the overrides it trains with. Its runs are the GPU's (docs/benchmarks.md); one runs on the CPU in a minute."""

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "scripts" / "bench"
sys.path.insert(0, str(BENCH))

from grpo_step_lib import PRESETS  # noqa: E402
from save_stall import settings, summarise  # noqa: E402


def test_the_stall_of_a_save_is_the_wait_plus_the_next_steps_excess(tmp_path):
    steps = [3.0, 1.0, 1.5, 1.0, 1.0, 2.0]  # step 1 compiles; saves after steps 2 and 4, the final one at 6
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "timing/step_s": s}) + "\n"
                                                    for i, s in enumerate(steps)))
    log = ("INFO checkpoint step_2: the loop waited 0.25 s, writing it in the background\n"
           "INFO checkpoint step_4: the loop waited 0.50 s, writing it in the background\n"
           "INFO checkpoint step_6: the loop waited 7.00 s\n")
    summary = summarise(tmp_path, log, save_every=2, steps=6)
    # median of steps 2..6 = median(1, 1.5, 1, 1, 2) = 1.0; step 3 took 0.5 s more, step 5 nothing more
    assert summary["median_step_s"] == 1.0
    assert summary["stall_per_save_s"] == {2: 0.75, 4: 0.5}
    assert summary["mean_stall_per_save_s"] == pytest.approx(0.625)
    assert summary["final_save_s"] == 7.0


@pytest.mark.parametrize("background", [False, True])
def test_each_run_saves_as_asked_with_every_setting_given_once(tmp_path, background):
    workspace = tmp_path / "work"
    (workspace / "model").mkdir(parents=True)
    (workspace / "model" / "config.json").write_text(json.dumps({"max_position_embeddings": 512}))
    given = settings(PRESETS["tiny"], workspace, "megatron", steps=7, save_every=2, background=background)
    keys = [setting.split("=", 1)[0] for setting in given]
    assert len(keys) == len(set(keys))
    assert {f"trainer.async_save={str(background).lower()}", "trainer.save_every=2", "trainer.total_steps=7",
            "policy.backend=megatron"} <= set(given)
