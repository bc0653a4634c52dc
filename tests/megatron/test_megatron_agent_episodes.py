"""Agent episodes on the Megatron backend: `aligner-ext train` under torchrun with the rollout engine on the
backend's own decoder, each episode's later turns continuing on its kept KV cache; the engine's log-probs
of the sampled tokens are the trainer's. Two launches: one process at TP=1, and two at TP=2, where rank 0
plays the episodes and rank 1 repeats its turn-session calls (agents/ranks.py): the same episodes as at
TP=1 (the step's and the held-out evaluation's episode counts and rewards before any update differ by
the shards' float sums at most, which sample the same tokens)."""

import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from megatron_cases import torchrun  # noqa: E402
from test_megatron_train_loop import E2E, OVERRIDES  # noqa: E402

pytestmark = pytest.mark.slow

AGENT = ["generator.engine=rollout", "algorithm.experience_maker=agent_episodes",
         "agents.environment=e2e_environments.Retry", "agents.limits.max_turns=2", "agents.limits.max_total_tokens=256",
         "rollout.max_response_length=24", "trainer.total_steps=2", "trainer.save_every=0", "trainer.tensorboard=false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, list[dict]]:
    """Each layout's metrics records, by tensor-parallel size."""
    root = tmp_path_factory.mktemp("megatron_agents")
    for tp in (1, 2):
        torchrun(["-m", "aligner_ext", "train", *OVERRIDES, *AGENT, f"policy.tensor_model_parallel_size={tp}",
                  f"trainer.output_dir={root}", f"trainer.run_name=tp{tp}"], processes=tp, pythonpath=(str(E2E),))
    return {tp: [json.loads(line) for line in (root / f"tp{tp}" / "metrics.jsonl").read_text().splitlines()]
            for tp in (1, 2)}


@pytest.mark.parametrize("tp", [1, 2])
def test_episodes_continue_on_the_megatron_decoders_kept_cache(runs, tp):
    steps = runs[tp][1:]
    assert [step["step"] for step in steps] == [1, 2]
    for step in steps:
        assert 1 <= step["agent/turns"] <= 2 and step["agent/history_rewrites"] == 0
        assert step["agent/reused_tokens_per_turn"] > 0 and step["agent/recomputed_tokens_per_turn"] == 0
        assert step["rollout/logprob_diff_max"] < 1e-4  # sampled tokens only; the feedback has no engine log-prob


def test_two_tensor_parallel_ranks_play_the_one_process_episodes(runs):
    def episodes(record: dict) -> dict:
        return {key: value for key, value in record.items()
                if key.startswith(("agent/", "val/", "reward/", "batch/")) and not key.endswith("_seconds")}

    (evaluated, first), (evaluated_tp2, first_tp2) = runs[1][:2], runs[2][:2]
    assert episodes(evaluated_tp2) == episodes(evaluated) and "val/agent/turns" in evaluated
    assert episodes(first_tp2) == pytest.approx(episodes(first), rel=0, abs=1e-6) and "agent/turns" in first
