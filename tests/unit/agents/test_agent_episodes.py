"""The agent-episodes experience maker (experience/agent_episodes.py): one batch row per episode with
the prompt the template rendered, the rest as the response, each token's role in `token_roles`, the
loss and the engine's log-probs on sampled tokens only, and the episode's reward (the environment's, or
the reward registry's of the last turn, plus the per-turn rewards) on the last sampled token."""

from dataclasses import replace

import pytest
import torch

from aligner_ext.agents.environment import Environment, Episode, StepResult, register_environment
from aligner_ext.agents.settings import AgentsConfig
from aligner_ext.batch import OBSERVATION, SAMPLED, TEMPLATE
from aligner_ext.data.types import PromptDraw, PromptRow
from aligner_ext.experience.agent_episodes import AgentEpisodes
from aligner_ext.experience.settings import RolloutConfig
from aligner_ext.generation.base import SamplingParams
from aligner_ext.rewards.manager import RewardManager
from aligner_ext.rewards.settings import RewardConfig

from tests.unit.agents.scripted import Adder, ScriptedPolicy, calls_then_answers, draws


def maker(tokenizer, engine, environment="test_adder"):
    rewards = RewardManager(RewardConfig(sources={"test": "exact_match"}, num_workers=1))
    return AgentEpisodes(AgentsConfig(environment=environment), RolloutConfig(n=2, max_response_length=64), engine,
                         rewards, tokenizer, seed=3)


def test_rows_hold_the_rendered_prompt_then_every_token_with_its_role(qwen25_tokenizer):
    engine = ScriptedPolicy(qwen25_tokenizer, calls_then_answers)
    agents = maker(qwen25_tokenizer, engine)
    outcomes, _ = agents.runner.run(draws((12, 30), (1, 1)), 2, SamplingParams(max_new_tokens=64, seed=0, return_logprobs=True))
    batch = agents.assemble_episodes(outcomes)
    assert len(batch) == 4 and batch.group_ids.tolist() == [0, 0, 1, 1]
    for row, outcome in enumerate(outcomes):
        (trajectory,) = outcome.rows
        start = trajectory.prompt_length()
        prompt = batch.prompt_ids[row][batch.prompt_mask[row]].tolist()
        assert prompt == trajectory.ids[:start] and prompt in [ids for ids, _, _ in engine.calls]  # the first turn's prompt
        response = batch.response_ids[row][batch.response_valid[row]].tolist()
        assert prompt + response == trajectory.ids
        roles = batch.token_roles[row][batch.response_valid[row]].tolist()
        expected = [{"sampled": SAMPLED, "template": TEMPLATE, "observation": OBSERVATION}[r] for r in trajectory.roles[start:]]
        assert roles == expected and TEMPLATE in roles and OBSERVATION in roles
        assert torch.equal(batch.response_mask[row], batch.token_roles[row] == SAMPLED)
        assert batch.response_mask[row].sum() < batch.response_valid[row].sum()
        logprobs = batch.generation_logprobs[row]
        assert torch.all(logprobs[batch.token_roles[row] != SAMPLED] == 0)
        assert torch.all(logprobs[batch.response_mask[row]] < 0)
        # reward: the environment's score (1: the answer is the tool's sum) + 0.25 for the one tool turn
        assert batch.rewards[row] == 1.25 and batch.correct[row] == 1.0
        last = int(torch.nonzero(batch.response_mask[row]).max())
        assert batch.token_rewards[row, last] == 1.25 and batch.token_rewards[row].sum() == 1.25
        assert batch.samples[row].response_text == str(sum(outcome.draw.row.ground_truth))


class Unscored(Adder):
    """Adder whose episodes the reward registry scores: the row's ground truth is the answer's text."""

    async def reset(self, row):
        return await super().reset(replace(row, ground_truth=row.extra_info["pair"]))

    async def score(self, state):
        return None


def test_without_an_environment_score_the_reward_registry_scores_the_last_turn(qwen25_tokenizer):
    register_environment("test_unscored")(Unscored)
    agents = maker(qwen25_tokenizer, ScriptedPolicy(qwen25_tokenizer, calls_then_answers), "test_unscored")
    rows = [PromptDraw(PromptRow("right", [], "test", ground_truth="5", extra_info={"pair": (2, 3)}), [], 0),
            PromptDraw(PromptRow("wrong", [], "test", ground_truth="6", extra_info={"pair": (2, 3)}), [], 1)]
    outcomes, _ = agents.runner.run(rows, 1, SamplingParams(max_new_tokens=64, seed=0))
    batch = agents.assemble_episodes(outcomes)
    assert batch.rewards.tolist() == [1.25, 0.25]  # exact match of "5" (1 or 0) + the tool turn's 0.25
    assert batch.correct.tolist() == [1.0, 0.0]


class Unowned(Environment):
    """Defines no `score`: the reward registry scores its episodes."""

    async def reset(self, row):
        return Episode(list(row.messages))

    async def step(self, message, state):
        return StepResult(done=True)


def test_the_build_checks_reward_functions_only_for_rows_no_environment_scores():
    import aligner_ext.plugins  # noqa: F401 - the built-in environments, as a run registers them
    from aligner_ext.config import load_config
    from aligner_ext.errors import ConfigError

    cfg = load_config("base", ["algorithm.experience_maker=agent_episodes", "agents.limits.max_total_tokens=512"])
    guess = PromptRow("g", [], "guess_number")  # guess_number scores its own episodes
    calculator = PromptRow("c", [], "calculator_arithmetic")  # so does the calculator
    registry = PromptRow("u", [], "test")  # Unowned leaves it to the reward registry
    assert AgentEpisodes.rows_scored_by_rewards(cfg, [guess, calculator]) == []
    named = load_config("base", ["algorithm.experience_maker=agent_episodes", "agents.limits.max_total_tokens=512",
                                 "agents.environment=tests.unit.agents.test_agent_episodes:Unowned"])
    assert AgentEpisodes.rows_scored_by_rewards(named, [registry]) == [registry]
    with pytest.raises(ConfigError, match="row u: no environment is named and none is registered for data_source 'test'"):
        AgentEpisodes.rows_scored_by_rewards(cfg, [registry])
