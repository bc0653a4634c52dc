"""DAPO's overlong reward shaping and overlong filtering against the paper's piecewise formula, as the
experience wrapper `overlong` applies them; with dynamic sampling, and the settings that are refused."""

from types import SimpleNamespace

import pytest
import torch

from aligner_ext.batch import ExperienceBatch, SampleInfo
from aligner_ext.config import RunConfig, load_config
from aligner_ext.data.types import PromptRow
from aligner_ext.experience.base import ExperienceMaker, RolloutConfig
from aligner_ext.experience.dynamic_sampling import DynamicSampling, DynamicSamplingConfig
from aligner_ext.experience.overlong import OverlongShaping, overlong_penalty

CAP = 10  # rollout.max_response_length of these tests


def r_length(length, cap, buffer):
    """DAPO eq. (13): 0 up to cap - buffer, ((cap - buffer) - |y|) / buffer inside the buffer, -1 beyond the cap."""
    if length <= cap - buffer:
        return 0.0
    if length <= cap:
        return ((cap - buffer) - length) / buffer
    return -1.0


class FixedMaker(ExperienceMaker):
    """Returns one batch of responses with the given lengths, rewards and finish reasons, in groups of 2."""

    def __init__(self, lengths, rewards, finishes):
        self.lengths, self.rewards, self.finishes = lengths, rewards, finishes

    def make_experience(self, loader, step):
        rows = len(self.lengths)
        valid = torch.arange(CAP)[None, :] < torch.tensor(self.lengths, dtype=torch.long)[:, None]
        rewards = torch.tensor(self.rewards, dtype=torch.float32)
        token_rewards = torch.zeros(rows, CAP)
        for row, length in enumerate(self.lengths):
            if length:
                token_rewards[row, length - 1] = rewards[row]
        batch = ExperienceBatch(
            prompt_ids=torch.ones(rows, 1, dtype=torch.long), prompt_mask=torch.ones(rows, 1, dtype=torch.bool),
            response_ids=torch.ones(rows, CAP, dtype=torch.long), response_valid=valid, response_mask=valid.clone(),
            group_ids=torch.arange(rows) // 2,
            samples=[SampleInfo(row=PromptRow(row_id=f"o:{i}", messages=[], data_source="o"), finish_reason=finish)
                     for i, finish in enumerate(self.finishes)],
            rewards=rewards, correct=rewards.clone(), token_rewards=token_rewards,
        )
        return batch, {"reward/num_errors": 0.0}


def rollout(**settings) -> RolloutConfig:
    return RolloutConfig(max_response_length=CAP, **settings)


@pytest.mark.parametrize("buffer", [1, 4, 10])
def test_penalty_matches_the_papers_formula(buffer):
    lengths = torch.arange(0, CAP + 3)  # past the cap too (an engine never returns those)
    expected = [1.5 * r_length(n, CAP, buffer) for n in lengths.tolist()]
    assert overlong_penalty(lengths, CAP, buffer, 1.5).tolist() == pytest.approx(expected, abs=1e-15)


def test_shaping_adds_the_penalty_to_rewards_and_the_last_token_and_keeps_correct():
    # buffer round(0.4 * 10) = 4 tokens: lengths 5, 6, 8, 10 -> 0, 0, -0.5, -1
    inner = FixedMaker([5, 6, 8, 10], [1.0, 0.0, 1.0, 1.0], ["eos", "eos", "eos", "length"])
    batch, metrics = OverlongShaping(inner, rollout(overlong_buffer_fraction=0.4)).make_experience(None, 0)
    assert batch.rewards.tolist() == [1.0, 0.0, 0.5, 0.0]
    assert batch.token_rewards.sum(dim=1).tolist() == [1.0, 0.0, 0.5, 0.0]
    assert batch.token_rewards[2, 7].item() == 0.5 and batch.token_rewards[3, 9].item() == 0.0
    assert batch.correct.tolist() == [1.0, 0.0, 1.0, 1.0]  # the raw outcome is not shaped
    assert batch.response_mask.equal(batch.response_valid)  # no filtering asked
    assert metrics == {"reward/num_errors": 0.0, "overlong/shaped_fraction": 0.5, "overlong/penalty_mean": -0.375}


def test_filtering_masks_truncated_responses_out_of_the_loss():
    inner = FixedMaker([3, 10, 10, 0], [1.0, 1.0, 0.0, 0.0], ["stop", "length", "eos", "length"])
    batch, metrics = OverlongShaping(inner, rollout(overlong_filter=True)).make_experience(None, 0)
    assert batch.response_mask.sum(dim=1).tolist() == [3, 0, 10, 0]  # "eos" at the cap finished: it stays
    assert batch.rewards.tolist() == [1.0, 1.0, 0.0, 0.0]  # no shaping asked
    assert metrics["overlong/filtered_fraction"] == 0.5 and "overlong/penalty_mean" not in metrics


def test_shaping_and_filtering_together():
    inner = FixedMaker([9, 10], [1.0, 1.0], ["eos", "length"])
    batch, metrics = OverlongShaping(inner, rollout(overlong_buffer_fraction=0.2, overlong_penalty=0.5,
                                                    overlong_filter=True)).make_experience(None, 0)
    assert batch.rewards.tolist() == [0.75, 0.5]  # 9 tokens: half the 2-token buffer; 10: all of it
    assert batch.response_mask.sum(dim=1).tolist() == [9, 0]
    assert metrics["overlong/shaped_fraction"] == 1.0 and metrics["overlong/filtered_fraction"] == 0.5


def test_an_empty_batch_is_shaped_without_error():
    inner = FixedMaker([], [], [])
    batch, metrics = OverlongShaping(inner, rollout(overlong_buffer_fraction=0.2, overlong_filter=True)
                                     ).make_experience(None, 0)
    assert len(batch) == 0
    assert metrics["overlong/penalty_mean"] == 0.0 and metrics["overlong/filtered_fraction"] == 0.0


def test_the_seq_reward_filter_sees_the_shaped_reward():
    # group 0: rewards 1, 1 but the second response is in the buffer -> shaped 1, 0.5: kept by seq_reward
    inner = FixedMaker([4, 9], [1.0, 1.0], ["eos", "eos"])
    shaped = OverlongShaping(inner, rollout(overlong_buffer_fraction=0.2))
    maker = DynamicSampling(shaped, DynamicSamplingConfig(enabled=True, filter_metric="seq_reward", max_gen_batches=1),
                            pad_token_id=0)
    loader = SimpleNamespace(batch_size=1, next_batch=lambda count=None: [])
    batch, metrics = maker.make_experience(loader, 0)
    assert len(batch) == 2 and metrics["dynamic_sampling/kept_groups"] == 1


def test_off_by_default_and_turned_on_by_the_dapo_overlay():
    ctx = SimpleNamespace(cfg=RunConfig())
    inner = FixedMaker([1], [1.0], ["eos"])
    assert OverlongShaping.from_context(inner, ctx) is inner
    dapo = load_config("base", ["+variant=dapo"])
    assert (dapo.rollout.overlong_buffer_fraction, dapo.rollout.overlong_penalty) == (0.2, 1.0)
    assert not dapo.rollout.overlong_filter
    assert isinstance(OverlongShaping.from_context(inner, SimpleNamespace(cfg=dapo)), OverlongShaping)
    assert dapo.algorithm.experience_wrappers[0] == "overlong"  # innermost: dynamic sampling sees shaped rewards


def test_refusals_name_the_setting():
    with pytest.raises(ValueError, match="rollout.overlong_buffer_fraction=0.01 of rollout.max_response_length=10 "
                                         "is 0 tokens"):
        OverlongShaping(FixedMaker([], [], []), rollout(overlong_buffer_fraction=0.01))
    with pytest.raises(ValueError, match="rollout.overlong_filter=true and variant mtpo do not compose"):
        load_config("base", ["+variant=mtpo", "rollout.overlong_filter=true"])
    with pytest.raises(ValueError, match="rollout.overlong_buffer_fraction>0 and variant mtpo do not compose"):
        load_config("base", ["+variant=mtpo", "rollout.overlong_buffer_fraction=0.2"])
    with pytest.raises(ValueError, match="is applied by the experience wrapper overlong, which "
                                         "algorithm.experience_wrappers does not list"):
        load_config("base", ["rollout.overlong_filter=true", "algorithm.experience_wrappers=[dynamic_sampling]"])
    # dapo with mtpo composes: the overlay's shaping is left off, as two-round rollouts have caps of their own
    assert load_config("base", ["+variant=[dapo,mtpo]"]).rollout.overlong_buffer_fraction == 0.0
