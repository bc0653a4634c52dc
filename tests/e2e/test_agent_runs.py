"""Agent episodes end to end on the embedded model (algorithm.experience_maker=agent_episodes): a
two-turn environment with feedback, through the loop, the trainer and the held-out evaluation."""

import json
from pathlib import Path

import pytest
import torch

from aligner_ext.config import load_config
from aligner_ext.trainer.loop import train
from tests.e2e.small_run import SMALL_MODEL

pytestmark = pytest.mark.slow

AGENT = ["algorithm.experience_maker=agent_episodes", "agents.environment=e2e_environments.Retry",
         "agents.limits.max_turns=2", "agents.limits.max_total_tokens=256", "rollout.max_response_length=24",
         "trainer.tensorboard=false", "+reward.sources.arithmetic=e2e_rewards.digit_fraction"]


def test_an_agent_run_trains_on_sampled_tokens_only_and_reports_its_episodes(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # e2e_environments, e2e_rewards (reward workers too)
    run = [f"trainer.output_dir={tmp_path}", "trainer.run_name=run", "trainer.total_steps=2"]
    summary = train(load_config("base", SMALL_MODEL + AGENT + run))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    step = records[1]
    # 4 prompts x 4 episodes of 1 or 2 turns; a wrong first answer is retried once
    assert step["batch/num_samples"] == 16
    assert 1 <= step["agent/turns"] <= 2 and step["agent/history_rewrites"] == 0
    assert step["agent/retries"] + step["agent/end_done"] == pytest.approx(step["agent/turns"])  # each turn: wrong, or done
    assert step["agent/end_done"] + step["agent/end_max_turns"] + step["agent/end_max_total_tokens"] == 1
    # the engine's log-probs are compared on sampled tokens only: feedback tokens have none
    assert step["rollout/logprob_diff_max"] < 1e-4
    for record in (records[0], records[2]):
        assert record["val/num_prompts"] == 8 and "val/agent/turns" in record
    assert "agent/turns" in summary.run_means
