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


def test_graded_prompt_groups_carried_over_keep_their_plans(tmp_path):
    """rollout.carry_over with the graded system prompt: a batch's groups begun at earlier steps keep each sample's
    graded generator prompt and its plan (the reward per disclosure ratio is logged for every ratio at every step),
    and a checkpoint holds the carried requests with their plans, read back by the weights-only loader."""
    from aligner_ext.experience.graded_prompt import GradedRequest
    from aligner_ext.trainer.checkpoint import STATE_FILE, load_trainer_state

    cfg = load_config("base", ["+variant=graded_prompt", *SMALL, f"trainer.output_dir={tmp_path}",
                               "trainer.run_name=carried", "trainer.total_steps=3", "trainer.save_every=2",
                               "generator.engine=rollout", "rollout.carry_over.groups=2",
                               "rollout.max_response_length=16"])
    train(cfg)
    records = [json.loads(line) for line in (tmp_path / "carried" / "metrics.jsonl").read_text().splitlines()]
    steps = [record for record in records if "carry_over/carried_groups" in record]
    assert len(steps) == 3 and all(step["carry_over/batch_share_carried"] > 0 for step in steps[1:])
    for step in steps:
        assert {f"graded_prompt/reward_mean_r{ratio}" for ratio in ("1.00", "0.67", "0.33", "0.00")} <= set(step)
        assert step["graded_prompt/system_prompt_tokens_mean"] > 0
    assert any(step["staleness/share_lag_1"] > 0 for step in steps[1:])  # carried tokens sampled a step before
    carried = load_trainer_state(tmp_path / "carried" / "checkpoints" / "step_2" / STATE_FILE)["maker"]["carried"]
    assert carried
    for group in carried:
        assert all(isinstance(request, GradedRequest) for request in group.requests)
        assert [request.group_ratio for request in group.requests] == pytest.approx([1, 2 / 3, 1 / 3, 0])
        full = group.requests[0]  # every criterion shown: its generator prompt is the plain one and a system message
        assert len(full.generation_prompt) == len(full.draw.prompt_ids) + full.system_tokens > len(full.draw.prompt_ids)
