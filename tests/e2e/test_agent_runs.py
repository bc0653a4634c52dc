"""Agent episodes end to end on the embedded model (algorithm.experience_maker=agent_episodes), training
LoRA adapters: a two-turn environment with a tool and feedback, through the loop, the trainer and the
held-out evaluation, generated ahead of training at max_staleness=0; the same run synchronous, killed with
SIGKILL in the middle of step 3's episodes (at a tool call, once the step-2 checkpoint is in place), resumes
to the same weights and metrics, so generating ahead at 0 is the synchronous run bit for bit. An agent of
user code (the openai client against the run's endpoint) generated ahead at max_staleness=1: every token of
its second batch one version behind. (Full-parameter training of agent episodes:
tests/megatron/test_megatron_agent_episodes.py.)"""

import json
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aligner_ext.config import load_config
from aligner_ext.trainer.loop import train
from tests.e2e.small_run import SMALL_MODEL, train_in_child

pytestmark = pytest.mark.slow

AGENT = ["algorithm.experience_maker=agent_episodes", "agents.environment=e2e_environments.CheckedRetry",
         "agents.limits.max_turns=2", "agents.limits.max_total_tokens=256", "rollout.max_response_length=24",
         "trainer.tensorboard=false", "+reward.sources.arithmetic=e2e_rewards.digit_fraction",
         "trainer.total_steps=3", "trainer.save_every=1",
         "policy.lora.rank=4", "policy.lora.alpha=8", "policy.optim.lr=1e-3"]


def killed_at_a_tool_call_in_step_3(latest: Path) -> str:
    """A patch for the child: it kills itself at the first tool call once its step-2 checkpoint is in place
    (`latest` names it), in step 3, while other episodes wait on the engine or on their own tools."""
    return ("import aligner_ext.agents.tools as tools\n"
            "real = tools.ToolRunner.run\n"
            f"LATEST = {str(latest)!r}\n"
            "async def run(self, turn):\n"
            "    if os.path.exists(LATEST) and open(LATEST).read() == 'step_2':\n"
            "        kill()\n"
            "    return await real(self, turn)\n"
            "tools.ToolRunner.run = run\n")


def records(path):
    """metrics.jsonl without wall-clock values and generation ahead's own counters."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "async/")) and not k.endswith("_seconds")}
            for r in rows]


def test_an_agent_run_trains_on_sampled_tokens_only_reports_its_episodes_and_resumes_after_a_sigkill(tmp_path,
                                                                                                     monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # e2e_environments, e2e_rewards (reward workers too)
    ahead = ["trainer.asynchronous.enabled=true", "trainer.asynchronous.max_staleness=0"]
    summary = train(load_config("base", SMALL_MODEL + AGENT + ahead + [f"trainer.output_dir={tmp_path}",
                                                                       "trainer.run_name=a"]))
    metrics = records(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 1, 2, 3]
    assert all(r["staleness/max"] == 0 for r in metrics[1:])
    step = metrics[1]
    # 4 prompts x 4 episodes of 1 or 2 turns; a wrong first answer is retried once
    assert step["batch/num_samples"] == 16
    assert 1 <= step["agent/turns"] <= 2 and step["agent/history_rewrites"] == 0
    assert step["agent/retries"] + step["agent/end_done"] == pytest.approx(step["agent/turns"])  # each turn: wrong, or done
    assert step["agent/checks"] == step["agent/retries"] > 0 and "agent/tool_errors" not in step  # a call per retry
    assert step["agent/end_done"] + step["agent/end_max_turns"] + step["agent/end_max_total_tokens"] == 1
    # the engine's log-probs are compared on sampled tokens only: feedback tokens have none
    assert step["rollout/logprob_diff_max"] < 1e-4
    for record in (metrics[0], metrics[3]):
        assert record["val/num_prompts"] == 8 and "val/agent/turns" in record
    assert "agent/turns" in summary.run_means

    # the same run synchronous in a child process, killed with SIGKILL in step 3, then run again
    run_b = [*SMALL_MODEL, *AGENT, f"trainer.output_dir={tmp_path}", "trainer.run_name=b"]
    killed = train_in_child(run_b, killed_at_a_tool_call_in_step_3(tmp_path / "b" / "checkpoints" / "latest"))
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert [r["step"] for r in records(tmp_path / "b" / "metrics.jsonl")] == [0, 1, 2]
    resumed = train_in_child(run_b)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stderr and "step_2 (step 2)" in resumed.stderr
    assert records(tmp_path / "b" / "metrics.jsonl") == metrics
    weights_a = load_file(str(tmp_path / "a" / "checkpoints" / "step_3" / "adapters.safetensors"))
    weights_b = load_file(str(tmp_path / "b" / "checkpoints" / "step_3" / "adapters.safetensors"))
    for name in weights_a:
        torch.testing.assert_close(weights_b[name], weights_a[name], rtol=0, atol=0)
    before = load_file(str(tmp_path / "a" / "checkpoints" / "step_2" / "adapters.safetensors"))
    assert any(not torch.equal(before[name], weights_a[name]) for name in before)  # step 3 moved the weights


def test_an_openai_sdk_agent_with_a_tool_trains_two_steps_on_its_sessions(tmp_path, monkeypatch):
    # agent code as the rollout (agents.agent): every episode two requests through the openai client
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # e2e_agents, e2e_rewards (reward workers too)
    overrides = ["algorithm.experience_maker=agent_episodes", "agents.agent=e2e_agents:calculator_agent",
                 "agents.limits.max_turns=2", "agents.limits.max_total_tokens=320", "rollout.max_response_length=24",
                 "trainer.tensorboard=false", "+reward.sources.arithmetic=e2e_rewards.digit_fraction",
                 "trainer.total_steps=2", "policy.optim.lr=1e-3", "generator.engine=rollout",
                 "trainer.asynchronous.enabled=true", "trainer.asynchronous.max_staleness=1"]  # its endpoint in the thread
    train(load_config("base", SMALL_MODEL + overrides + [f"trainer.output_dir={tmp_path}", "trainer.run_name=a"]))
    metrics = records(tmp_path / "a" / "metrics.jsonl")
    assert [r["step"] for r in metrics] == [0, 1, 2]
    for lag, step in enumerate(metrics[1:]):
        assert step["batch/num_samples"] == 16  # 4 prompts x 4 episodes, one row each
        assert step["agent/turns"] == 2 and step["agent/end_done"] == 1 and "agent/edited_history" not in step  # absent until counted
        assert step["agent/observation_tokens"] > 0
        assert step["actor/grad_norm"] > 0  # the rows' rewards differ within groups: the step trains
        # step 1's batch sampled the first weights, step 2's while step 1 trained: one version behind
        assert step["staleness/max"] == lag and step[f"staleness/share_lag_{lag}"] == 1
        # the rollout engine continued each second turn on the KV cache its first left
        assert step["agent/reused_tokens_per_turn"] > 0 and step["agent/recomputed_tokens_per_turn"] == 0
    # at lag 0 the trainer's log-probs of the rows' sampled tokens are the engine's (the rows are what it
    # sampled); at lag 1 they differ by step 1's update
    assert metrics[1]["rollout/logprob_diff_max"] < 1e-4 < metrics[2]["rollout/logprob_diff_mean_lag_1"]
    assert metrics[2]["val/num_prompts"] == 8 and metrics[2]["val/agent/turns"] == 2
