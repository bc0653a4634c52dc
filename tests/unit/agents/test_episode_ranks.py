"""Agent episodes under several processes (agents/ranks.py): one launch of 2 spawned CPU processes (gloo)
runs every case and saves what each rank got; the tests compare it with one process's episodes, played
here, and with counts worked out by hand.

The scripted policy's second turn answers the turn's seed, so an episode seeded by the wrong number
(by its place in a rank's share instead of in the call) has another trajectory.
- Split: 3 draws x 2 episodes over the rank split engine: rank 0 plays episodes 0-2, rank 1 episodes
  3-5 (each rank's engine sees only its share's turns), and both ranks return the 6 episodes one process
  plays, with the sessions' counts summed.
- Dynamic sampling around the split maker: a group all wrong is dropped and refilled by a call of fewer
  draws; every rank's batch and metrics are the one process's.
- Lockstep: a session whose lockstep group is both ranks: rank 0 plays the episodes and runs the
  environment; rank 1 resets no environment, its session receives the same calls in the same order and
  its engine samples the same turns; both return rank 0's outcomes. An environment that raises a
  UserError on rank 0 raises on rank 1 too, naming rank 0.
"""

import random

import pytest
import torch.distributed as dist

from aligner_ext.agents.environment import register_environment
from aligner_ext.agents.episodes import EpisodeRunner
from aligner_ext.agents.sessions import GenerateEachTurn
from aligner_ext.agents.settings import AgentsConfig
from aligner_ext.data.loader import DataConfig, PromptLoader
from aligner_ext.data.types import PromptRow
from aligner_ext.errors import UserError
from aligner_ext.experience.agent_episodes import AgentEpisodes
from aligner_ext.experience.dynamic_sampling import DynamicSampling, DynamicSamplingConfig
from aligner_ext.experience.settings import RolloutConfig
from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.sharded import RankSplitEngine
from aligner_ext.rewards.manager import RewardManager
from aligner_ext.rewards.settings import RewardConfig

from tests.unit.agents.conftest import QWEN_ADDED, QWEN_SPECIAL, chat_tokenizer
from tests.processes import init_rank, save_rank, spawn_ranks
from tests.unit.agents.scripted import Adder, ScriptedPolicy, calls_then_answers, draws

PARAMS = SamplingParams(max_new_tokens=64, seed=11, return_logprobs=True)
SUMS = ((12, 30), (1, 1), (2, 5))


def seeded_answer(text, seed):
    """Turn 1 calls add; turn 2 answers a number drawn from the turn's seed (not the sum)."""
    if "<tool_response>" in text:
        return str(random.Random(seed).randint(0, 999))
    return calls_then_answers(text, seed)


def sometimes_right(text, seed):
    """Turn 2 answers the tool's sum when the turn's seed draws below 0.3, else a number drawn from it."""
    if "<tool_response>" in text and random.Random(seed).random() >= 0.3:
        return str(random.Random(seed).randint(100, 999))
    return calls_then_answers(text, seed)


@register_environment("test_counted_adder")
class CountedAdder(Adder):
    resets = 0

    async def reset(self, row):
        CountedAdder.resets += 1
        return await super().reset(row)


@register_environment("test_refusing_adder")
class RefusingAdder(Adder):
    async def step(self, message, state):
        raise UserError("agents.environment needs a sandbox this machine lacks")


class RecordedSession(GenerateEachTurn):
    """Each turn by `generate`, every call recorded; decodes in lockstep with `group`."""

    def __init__(self, engine, params, group):
        super().__init__(engine, params)
        self.lockstep_group, self.calls = group, []

    def submit(self, key, ids, max_new_tokens, seed):
        self.calls.append(("submit", key, len(ids), seed))
        super().submit(key, ids, max_new_tokens, seed)

    def step(self):
        done = super().step()
        self.calls.append(("step", [key for key, _ in done]))
        return done

    def release(self, key):
        self.calls.append(("release", key))


class LockstepPolicy(ScriptedPolicy):
    def __init__(self, tokenizer, reply, group):
        super().__init__(tokenizer, reply)
        self.group, self.sessions = group, []

    def open_session(self, params, max_length, max_episodes):
        self.sessions.append(RecordedSession(self, params, self.group))
        return self.sessions[-1]


def trajectories(outcomes) -> list:
    return [(o.draw.draw_id, o.end, [(t.ids, t.roles, t.logprobs) for t in o.rows], o.final_text) for o in outcomes]


def play(engine, tokenizer, environment="test_counted_adder"):
    runner = EpisodeRunner(engine, tokenizer, AgentsConfig(environment=environment))
    outcomes, counts = runner.run(draws(*SUMS), 2, PARAMS)
    return trajectories(outcomes), dict(counts)


def dynamic_batch(engine, tokenizer) -> tuple:
    """One step of dynamic sampling around agent episodes (2 per draw, 3 draws a step): the batch's groups,
    responses and rewards, and the step's metrics."""
    rows = [PromptRow(f"row{i}", [{"role": "user", "content": "-"}], "test", ground_truth=(i, 2 * i))
            for i in range(12)]
    rewards = RewardManager(RewardConfig(sources={"test": "exact_match"}, num_workers=1))
    maker = AgentEpisodes(AgentsConfig(environment="test_adder"), RolloutConfig(n=2, max_response_length=64), engine,
                          rewards, tokenizer, seed=3)
    wrapped = DynamicSampling(maker, DynamicSamplingConfig(max_gen_batches=6), pad_token_id=0)
    loader = PromptLoader(rows, tokenizer, DataConfig(), batch_size=3, shuffle=False)
    batch, metrics = wrapped.make_experience(loader, 1)
    responses = [ids[valid].tolist() for ids, valid in zip(batch.response_ids, batch.response_valid)]
    return (batch.group_ids.tolist(), responses, batch.rewards.tolist()), metrics


def worker(rank: int, directory: str) -> None:
    init_rank(rank, directory)
    tokenizer = chat_tokenizer("qwen2_5.jinja", QWEN_SPECIAL, QWEN_ADDED, eos="<|im_end|>")
    got = {}
    policy = ScriptedPolicy(tokenizer, seeded_answer)
    got["split"], got["split_counts"] = play(RankSplitEngine(policy), tokenizer)
    got["split_prompts"] = [(len(ids), seed) for ids, _, seed in policy.calls]
    got["split_resets"], CountedAdder.resets = CountedAdder.resets, 0

    got["dynamic"], got["dynamic_metrics"] = dynamic_batch(RankSplitEngine(ScriptedPolicy(tokenizer, sometimes_right)),
                                                           tokenizer)

    policy = LockstepPolicy(tokenizer, seeded_answer, dist.new_group([0, 1], backend="gloo"))
    got["lockstep"], got["lockstep_counts"] = play(policy, tokenizer)
    got["lockstep_calls"] = policy.sessions[0].calls
    got["lockstep_prompts"] = [(ids, seed) for ids, _, seed in policy.calls]
    got["lockstep_resets"] = CountedAdder.resets
    try:
        play(policy, tokenizer, "test_refusing_adder")
        got["error"] = "no error"
    except Exception as err:  # noqa: BLE001 - the test reads which error each rank raised
        got["error"] = f"{type(err).__name__}: {err}"
    save_rank(got, rank, directory)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(worker, tmp_path_factory.mktemp("episode_ranks"))


@pytest.fixture(scope="module")
def alone(qwen25_tokenizer):
    """The same episodes in one process, and the turns its engine sampled."""
    policy = ScriptedPolicy(qwen25_tokenizer, seeded_answer)
    episodes, counts = play(policy, qwen25_tokenizer)
    return episodes, counts, [(len(ids), seed) for ids, _, seed in policy.calls]


def test_split_ranks_play_their_share_and_return_the_one_process_episodes(ranks, alone):
    episodes, counts, prompts = alone
    assert len(episodes) == 6 and len({answer for *_, answer in episodes}) == 6  # each episode's own seed
    for got in ranks:
        assert got["split"] == episodes
        assert got["split_counts"] == {"turns": 12, "prefilled_tokens": counts["prefilled_tokens"]}
    # two turns an episode: rank 0 samples episodes 0-2's turns, rank 1 episodes 3-5's
    assert sorted(ranks[0]["split_prompts"] + ranks[1]["split_prompts"]) == sorted(prompts)
    assert len(ranks[0]["split_prompts"]) == len(ranks[1]["split_prompts"]) == 6
    assert [got["split_resets"] for got in ranks] == [3, 3]


def test_dynamic_sampling_around_split_episodes_gives_every_rank_the_one_process_batch(ranks, qwen25_tokenizer):
    batch, metrics = dynamic_batch(ScriptedPolicy(qwen25_tokenizer, sometimes_right), qwen25_tokenizer)
    # the first call's 3 draws leave a group all wrong, refilled by a call of 1 draw (an episode on each rank)
    assert metrics["dynamic_sampling/num_gen_batches"] >= 2 and metrics["dynamic_sampling/discarded_groups"] > 0
    assert len(set(batch[0])) == 3 and set(batch[2]) == {0.25, 1.25}  # kept groups: a right and a wrong answer
    for got in ranks:
        assert got["dynamic"] == batch
        assert {k: v for k, v in got["dynamic_metrics"].items() if "seconds" not in k} == \
            {k: v for k, v in metrics.items() if "seconds" not in k}


def test_lockstep_rank_0_plays_and_rank_1_repeats_its_session_calls(ranks, alone):
    first, second = ranks
    assert first["lockstep"] == second["lockstep"] == alone[0]
    expected_counts = {"turns": 12, "prefilled_tokens": alone[1]["prefilled_tokens"]}
    assert first["lockstep_counts"] == second["lockstep_counts"] == expected_counts
    assert second["lockstep_calls"] == first["lockstep_calls"]
    assert [call[0] for call in first["lockstep_calls"]].count("submit") == 12
    assert second["lockstep_prompts"] == first["lockstep_prompts"]  # the same turns sampled, in the same order
    assert (first["lockstep_resets"], second["lockstep_resets"]) == (6, 0)


def test_an_error_of_the_playing_rank_raises_on_the_repeating_rank(ranks):
    assert ranks[0]["error"] == "UserError: agents.environment needs a sandbox this machine lacks"
    assert ranks[1]["error"] == ("RuntimeError: the episodes failed on rank 0, which plays them for this rank "
                                 "(UserError: agents.environment needs a sandbox this machine lacks)")
