"""Generation and reward calls split across ranks (aligner_ext/generation/sharded.py, distributed.map_split).

One launch of 2 spawned CPU processes (gloo) runs every case; each rank saves what it got and the
tests compare both ranks with outputs worked out by hand. The fake engine returns, per prompt,
[the prompt's first id, the seed of its call, the rank that generated it], so order, split and
per-rank seeds can all be read off the outputs.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from aligner_ext.data.types import PromptRow
from aligner_ext.distributed import share
from aligner_ext.generation.base import GenerationEngine, GenerationOutput, SamplingParams
from aligner_ext.generation.sharded import rank_seed, split_across_ranks
from aligner_ext.rewards.manager import RewardConfig, RewardManager
from tests.processes import init_rank, save_rank, spawn_ranks

REWARD_HELPERS = Path(__file__).resolve().parent.parent / "rewards"  # reward_helper_fns.py
SAMPLED = SamplingParams(max_new_tokens=4, temperature=1.0, seed=7)


class EchoEngine(GenerationEngine):
    """Output i: [prompt i's first id, the call's seed, this rank]; refuses prompts starting with a negative id."""

    def __init__(self):
        self.share_sizes: list[int] = []

    def generate(self, prompts, params):
        self.share_sizes.append(len(prompts))
        if any(prompt[0] < 0 for prompt in prompts):
            raise ValueError("negative prompt id")
        return [GenerationOutput([prompt[0], params.seed, dist.get_rank()], "length", [float(prompt[0])])
                for prompt in prompts]


class CountingRewards(RewardManager):
    """Records how many calls each `_run` (this rank's pool) got."""

    share_sizes: list[int]

    def _run(self, calls):
        self.share_sizes = [*getattr(self, "share_sizes", []), len(calls)]
        return super()._run(calls)


def row(source: str, answer: str, index: int) -> PromptRow:
    return PromptRow(row_id=f"r{index}", messages=[{"role": "user", "content": "q"}], data_source=source,
                     ground_truth=answer)


def error_of(call) -> str:
    try:
        call()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def worker(rank: int, directory: str) -> None:
    sys.path.insert(0, str(REWARD_HELPERS))
    init_rank(rank, directory)
    torch.manual_seed(0)  # the same global RNG state on both ranks
    inner = EchoEngine()
    engine = split_across_ranks(inner, True)
    got = {
        "wrapped": type(engine).__name__, "unwrapped_when_off": split_across_ranks(inner, False) is inner,
        "five": [o.token_ids for o in engine.generate([[10], [11], [12], [13], [14]], SAMPLED)],
        "five_logprobs": [o.logprobs for o in engine.generate([[10], [11], [12], [13], [14]], SAMPLED)],
        "one": [o.token_ids for o in engine.generate([[10]], SAMPLED)],
        "none": engine.generate([], SAMPLED),
        "greedy": [o.token_ids for o in engine.generate([[10], [11]], SamplingParams(temperature=0.0))],
        "unseeded": [o.token_ids for o in engine.generate([[10], [11]], SamplingParams(temperature=1.0))],
        "error": error_of(lambda: engine.generate([[10], [11], [-1]], SAMPLED)),
        "after_error": [o.token_ids for o in engine.generate([[20], [21]], SAMPLED)],
        "share_sizes": inner.share_sizes,
    }
    cfg = RewardConfig(num_workers=1, sources={"bad": "reward_helper_fns:raise_error"})
    with CountingRewards(cfg) as rewards:
        rows = [row("arithmetic", "3", 0), row("arithmetic", "4", 1), row("arithmetic", "5", 2), row("bad", "", 3)]
        results = rewards.score(["\\boxed{3}", "\\boxed{0}", "\\boxed{5}", "x"], rows)
        got["scores"] = [(r.score, r.correct) for r in results]
        got["reward_metrics"] = rewards.metrics()
        got["one_score"] = [r.score for r in rewards.score(["\\boxed{3}"], rows[:1])]
        got["reward_share_sizes"] = rewards.share_sizes
    save_rank(got, rank, directory)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(worker, tmp_path_factory.mktemp("rank_split"))


def test_share_gives_the_first_ranks_one_more_and_leaves_late_ranks_empty():
    assert [share(5, r, 2) for r in range(2)] == [range(0, 3), range(3, 5)]
    assert [share(7, r, 3) for r in range(3)] == [range(0, 3), range(3, 5), range(5, 7)]
    assert [share(1, r, 2) for r in range(2)] == [range(0, 1), range(1, 1)]
    assert [share(0, r, 2) for r in range(2)] == [range(0, 0), range(0, 0)]


def test_rank_seed_is_seed_times_world_plus_rank_and_greedy_keeps_its_seed():
    assert [rank_seed(SAMPLED, r, 2) for r in range(2)] == [14, 15]
    assert rank_seed(SAMPLED, 0, 1) == 7  # a world of one samples as the unsplit engine
    assert rank_seed(SamplingParams(temperature=0.0, seed=7), 1, 2) == 7
    assert rank_seed(SamplingParams(temperature=0.0), 1, 2) is None


def test_a_world_of_one_keeps_the_engine_unwrapped():
    engine = EchoEngine()
    assert split_across_ranks(engine, True) is engine


def test_outputs_are_gathered_in_request_order_and_identical_on_every_rank(ranks):
    first, second = ranks
    assert first["wrapped"] == "RankSplitEngine" and first["unwrapped_when_off"]
    # 5 prompts: rank 0 generates prompts 0-2 with seed 7 * 2 + 0, rank 1 prompts 3-4 with 7 * 2 + 1
    assert first["five"] == [[10, 14, 0], [11, 14, 0], [12, 14, 0], [13, 15, 1], [14, 15, 1]]
    assert first["five_logprobs"] == [[10.0], [11.0], [12.0], [13.0], [14.0]]
    assert first["one"] == [[10, 14, 0]]  # fewer prompts than ranks: rank 1 generates nothing
    assert first["none"] == []
    assert first["after_error"] == [[20, 14, 0], [21, 15, 1]]
    for key in first:
        if key not in ("share_sizes", "reward_share_sizes", "error"):
            assert second[key] == first[key], key


def test_each_rank_generates_only_its_share(ranks):
    # calls: five, five_logprobs, one, none, greedy, unseeded, error, after_error
    assert ranks[0]["share_sizes"] == [3, 3, 1, 0, 1, 1, 2, 1]
    assert ranks[1]["share_sizes"] == [2, 2, 0, 0, 1, 1, 1, 1]


def test_greedy_calls_keep_their_seed_and_unseeded_calls_get_one_stream_per_rank(ranks):
    assert ranks[0]["greedy"] == [[10, None, 0], [11, None, 1]]
    (a, seed_a, _), (b, seed_b, _) = ranks[0]["unseeded"]
    # both ranks drew the same number from equal global RNG states: base * 2 and base * 2 + 1
    assert (a, b) == (10, 11) and seed_a % 2 == 0 and seed_b == seed_a + 1


def test_an_error_on_one_rank_raises_on_every_rank_and_the_next_call_works(ranks):
    assert ranks[1]["error"] == "ValueError: negative prompt id"
    assert ranks[0]["error"] == ("RuntimeError: a split call failed on another rank "
                                 "(rank 1: ValueError: negative prompt id)")


def test_rewards_are_scored_once_split_and_identical_with_fallbacks_counted_once(ranks):
    first, second = ranks
    assert first["scores"] == second["scores"] == [(1.0, 1.0), (0.0, 0.0), (1.0, 1.0), (0.0, 0.0)]
    expected = {"reward/num_errors": 1.0, "reward/num_timeouts": 0.0, "reward/fallback_fraction": 0.25}
    assert first["reward_metrics"] == second["reward_metrics"] == expected
    assert first["one_score"] == second["one_score"] == [1.0]
    assert first["reward_share_sizes"] == [2, 1] and second["reward_share_sizes"] == [2, 0]
