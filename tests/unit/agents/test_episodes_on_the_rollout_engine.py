"""Episodes on the rollout engine's turn sessions (the kept KV cache) against the same engine run one
generate call per turn (a fresh prefill of the whole trajectory each turn): the same trajectories, ids
and log-probs, while the session prefills only each turn's new ids."""

import torch

from aligner_ext.agents.environment import Environment, Episode, StepResult, register_environment
from aligner_ext.agents.episodes import EpisodeRunner
from aligner_ext.agents.settings import AgentsConfig, EpisodeLimits
from aligner_ext.data.types import PromptDraw, PromptRow
from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.rollout import RolloutEngine
from aligner_ext.generation.settings import RolloutEngineConfig


@register_environment("test_three_replies")
class ThreeReplies(Environment):
    """Replies "no, again" to every turn; the episode runs to max_turns."""

    async def reset(self, row):
        return Episode([{"role": "user", "content": row.messages[0]["content"]}])

    async def step(self, message, state):
        return StepResult([{"role": "user", "content": "no, again"}])


class OneCallPerTurn:
    """The engine without its turn sessions: the episode loop falls back to a generate call per turn."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, params):
        return self.engine.generate(prompts, params)


def test_the_kept_cache_gives_the_fresh_prefills_episodes_and_prefills_only_new_ids(tiny_model, tiny_tokenizer):
    engine = RolloutEngine(tiny_model, tiny_tokenizer, RolloutEngineConfig(max_batch_size=8))
    draws = [PromptDraw(PromptRow(f"r{i}", [{"role": "user", "content": f"{i}+{i}="}], "t"), [], i) for i in range(3)]
    cfg = AgentsConfig(environment="test_three_replies", limits=EpisodeLimits(max_turns=3, max_total_tokens=200))
    params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, return_logprobs=True)
    kept, kept_stats = EpisodeRunner(engine, tiny_tokenizer, cfg).run(draws, 2, params)
    fresh, fresh_stats = EpisodeRunner(OneCallPerTurn(engine), tiny_tokenizer, cfg).run(draws, 2, params)
    assert [len(o.rows) for o in kept] == [1] * 6 and all(o.counts["turns"] == 3 for o in kept)
    for a, b in zip(kept, fresh):
        assert a.rows[0].ids == b.rows[0].ids and a.rows[0].roles == b.rows[0].roles
        torch.testing.assert_close(torch.tensor(a.rows[0].logprobs), torch.tensor(b.rows[0].logprobs), rtol=0, atol=1e-5)
    assert fresh_stats["turns"] == kept_stats["turns"] == 18
    # fresh: every turn prefills the whole trajectory before it. kept: each draw's first prompt once (its two
    # episodes' first turns share one prefill), then per later turn only its new ids: the previous turn's
    # last sampled id (never fed back), the template's and the observation's.
    turn_starts = [[i for i, role in enumerate(o.rows[0].roles) if role == "sampled" and o.rows[0].roles[i - 1] != "sampled"]
                   for o in fresh]
    assert fresh_stats["prefilled_tokens"] == sum(sum(starts) for starts in turn_starts)
    new_ids = sum(o.counts["template_tokens"] + o.counts["observation_tokens"] + o.counts["turns"] - 1 for o in kept)
    assert kept_stats["prefilled_tokens"] == sum(o.rows[0].prompt_length() for o in kept[::2]) + new_ids
    assert kept_stats["recomputed_tokens"] == 0 and kept_stats["evictions"] == 0
