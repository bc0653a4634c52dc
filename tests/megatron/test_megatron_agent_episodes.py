"""Agent episodes on the Megatron backend: `aligner-ext train` in one process (torchrun) with the rollout
engine on the backend's own decoder, each episode's later turns continuing on its kept KV cache; the
engine's log-probs of the sampled tokens are the trainer's."""

import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from megatron_cases import torchrun  # noqa: E402
from test_megatron_train_loop import E2E, OVERRIDES  # noqa: E402

pytestmark = pytest.mark.slow

AGENT = ["generator.engine=rollout", "algorithm.experience_maker=agent_episodes",
         "agents.environment=e2e_environments.Retry", "agents.limits.max_turns=2", "agents.limits.max_total_tokens=256",
         "rollout.max_response_length=24", "policy.tensor_model_parallel_size=1", "trainer.total_steps=2",
         "trainer.save_every=0", "trainer.tensorboard=false"]


def test_episodes_continue_on_the_megatron_decoders_kept_cache(tmp_path: Path):
    torchrun(["-m", "aligner_ext", "train", *OVERRIDES, *AGENT, f"trainer.output_dir={tmp_path}", "trainer.run_name=m"],
             processes=1, pythonpath=(str(E2E),))
    steps = [json.loads(line) for line in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()][1:]
    assert [step["step"] for step in steps] == [1, 2]
    for step in steps:
        assert 1 <= step["agent/turns"] <= 2 and step["agent/history_rewrites"] == 0
        assert step["agent/reused_tokens_per_turn"] > 0 and step["agent/recomputed_tokens_per_turn"] == 0
        assert step["rollout/logprob_diff_max"] < 1e-4  # sampled tokens only; the feedback has no engine log-prob
