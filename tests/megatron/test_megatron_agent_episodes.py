"""Agent episodes on the Megatron backend: `aligner-ext train` under torchrun with the rollout engine on the
backend's own decoder, each episode's later turns continuing on its kept KV cache; the engine's log-probs
of the sampled tokens are the trainer's. Two launches: one process (TP=1), and two at TP=2. In the
second, the first rank of the TP pair plays the episodes and runs the environment while the other repeats
its turn-session calls (agents/ranks.py). The playing rank reads the model turns of the one-process run's
episodes, each once; before any update, the held-out evaluation's and the first step's episode counts and
rewards are the one-process run's (the shards sum floats in another
order, which samples the same tokens here)."""

import json
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from megatron_cases import torchrun  # noqa: E402
from test_megatron_train_loop import E2E, OVERRIDES  # noqa: E402

pytestmark = pytest.mark.slow

AGENT = ["generator.engine=rollout", "algorithm.experience_maker=agent_episodes",
         "agents.environment=e2e_environments.Recorded", "agents.limits.max_turns=2", "agents.limits.max_total_tokens=256",
         "rollout.max_response_length=24", "trainer.total_steps=2", "trainer.save_every=0", "trainer.tensorboard=false"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, tuple[list[dict], dict[str, list[str]]]]:
    """Each layout's metrics records and the model turns each rank's environment read (by rank), by TP size."""
    root = tmp_path_factory.mktemp("megatron_agents")
    found = {}
    for tp, pp in ((1, 1), (2, 1)):
        log = root / f"tp{tp}_episodes"
        log.mkdir()
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.setenv("E2E_EPISODE_LOG", str(log))
            torchrun(["-m", "aligner_ext", "train", *OVERRIDES, *AGENT, f"policy.tensor_model_parallel_size={tp}",
                      f"policy.pipeline_model_parallel_size={pp}", f"trainer.output_dir={root}",
                      f"trainer.run_name=tp{tp}"], processes=tp * pp, pythonpath=(str(E2E),))
        metrics = [json.loads(line) for line in (root / f"tp{tp}" / "metrics.jsonl").read_text().splitlines()]
        found[tp] = metrics, {path.stem: path.read_text().splitlines() for path in sorted(log.glob("rank*.jsonl"))}
    return found


@pytest.mark.parametrize("tp", [1, 2])
def test_episodes_continue_on_the_megatron_decoders_kept_cache(runs, tp):
    steps = runs[tp][0][1:]
    assert [step["step"] for step in steps] == [1, 2]
    for step in steps:
        assert 1 <= step["agent/turns"] <= 2 and step["agent/history_rewrites"] == 0
        assert step["agent/reused_tokens_per_turn"] > 0 and step["agent/recomputed_tokens_per_turn"] == 0
        assert step["rollout/logprob_diff_max"] < 1e-4  # sampled tokens only; the feedback has no engine log-prob


def test_tensor_parallel_ranks_play_the_one_process_episodes_once(runs):
    def episodes(record: dict) -> dict:
        """The episodes' counts and rewards; not wall times, nor the prefilled tokens, which depend on which
        first turns (their environments' resets run in threads) are admitted together, sharing a prefill."""
        return {key: value for key, value in record.items()
                if key.startswith(("agent/", "val/", "reward/", "batch/"))
                and not key.endswith(("_seconds", "prefilled_tokens_per_turn"))}

    (metrics, log), (metrics_tp2, log_tp2) = runs[1], runs[2]
    for record, record_tp2 in zip(metrics[:2], metrics_tp2[:2]):
        assert episodes(record_tp2) == episodes(record)
    assert "val/agent/turns" in metrics[0] and "agent/turns" in metrics[1]
    # rank 1 ran no environment: it repeated rank 0's session calls
    assert list(log_tp2) == ["rank0"]
    assert sorted(log_tp2["rank0"]) == sorted(log["rank0"])
