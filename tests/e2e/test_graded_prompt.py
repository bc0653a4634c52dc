"""A small end-to-end run of the graded system prompt variant on the built-in rubric task."""

import json

import pytest

from aligner_ext.config import load_config
from aligner_ext.trainer.loop import train
from small_run import SMALL_MODEL

pytestmark = pytest.mark.slow

SMALL = SMALL_MODEL + ["trainer.tensorboard=false"]


def test_graded_prompt_run_logs_the_reward_per_disclosure_ratio(tmp_path):
    cfg = load_config("base", ["+variant=graded_prompt", *SMALL, f"trainer.output_dir={tmp_path}",
                               "trainer.run_name=run", "trainer.total_steps=2"])
    assert cfg.algorithm.experience_maker == "graded_prompt" and cfg.data.builtin_task == "rubric_qa"
    summary = train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = records[1]
    assert step["graded_prompt/active"] == 1.0
    ratios = ["1.00", "0.67", "0.33", "0.00"]  # n = 4: (3 - i) / 3
    for ratio in ratios:
        assert -4 / 7 - 1e-6 <= step[f"graded_prompt/reward_mean_r{ratio}"] <= 1.0 + 1e-6  # rubric_qa score range
    assert step["graded_prompt/system_prompt_tokens_mean"] > 0
    assert step["graded_prompt/num_plain_samples_no_rubric"] == 0.0
    # old log-probs come from the policy on the trained (original) prompt: the first update's ratio is 1
    assert step["actor/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert set(summary.run_means) == {f"graded_prompt/reward_mean_r{ratio}" for ratio in ratios}
    assert "val/reward_mean" in records[-1]
