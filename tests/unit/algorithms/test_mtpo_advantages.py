"""MTPO segment advantages on G = 2 answers x H = 3 confidences per prompt, worked by hand; the
first-confidence-only mask and the loss denominators it implies."""

import math

import pytest
import torch

from aligner_ext.algorithms.advantages import GroupAdvantage
from aligner_ext.algorithms.mtpo import MTPOAdvantage, answer_advantages
from aligner_ext.batch import ExperienceBatch, SampleInfo
from aligner_ext.data.types import PromptRow
from aligner_ext.losses.clipped_pg import ClippedPGLoss

# Two prompts (group ids 10, 11), G = 2 answers each, H = 3 continuations per answer: 12 rows.
GROUPS = [10] * 6 + [11] * 6
ANSWERS = [100] * 3 + [101] * 3 + [110] * 3 + [111] * 3
ANSWER_REWARDS = [1.5] * 3 + [0.5] * 3 + [1.0] * 6  # prompt 11: both answers earn 1.0 -> A_ans = 0
CONFIDENCE_REWARDS = [1.0, 0.75, 0.5, 0.96, 0.36, 0.36, 0.2, 0.2, 0.2, 0.0, 0.6, 0.3]
# Each response: 2 round-1 tokens then 2 round-2 tokens; the last row has only one round-2 token.
SEGMENTS = [0, 0, 1, 1]
FIRST_COPY = [True, False, False] * 4


def make_batch(first_only: bool) -> ExperienceBatch:
    valid = torch.ones(12, 4, dtype=torch.bool)
    valid[11, 3] = False
    segments = torch.tensor([SEGMENTS] * 12)
    mask = valid.clone()
    if first_only:
        mask &= ~((segments == 0) & ~torch.tensor(FIRST_COPY)[:, None])
    return ExperienceBatch(
        prompt_ids=torch.ones(12, 1, dtype=torch.long), prompt_mask=torch.ones(12, 1, dtype=torch.bool),
        response_ids=torch.ones(12, 4, dtype=torch.long), response_valid=valid, response_mask=mask,
        group_ids=torch.tensor(GROUPS), answer_group_ids=torch.tensor(ANSWERS), segment_ids=segments,
        answer_rewards=torch.tensor(ANSWER_REWARDS), confidence_rewards=torch.tensor(CONFIDENCE_REWARDS),
        samples=[SampleInfo(row=PromptRow(row_id=f"t:{i}", messages=[], data_source="t")) for i in range(12)],
    )


# By hand, use_std = True (unbiased std over the G answers, over the H continuations):
# A_ans prompt 10: rewards 1.5, 0.5 -> mean 1.0, std sqrt(0.25 + 0.25) = 0.70711 -> +-0.70711 (one value per answer;
#   over the 6 repeated rows the std would be sqrt(6 * 0.25 / 5) = 0.54772 and A = +-0.91287)
# A_conf answer 100: 1.0, 0.75, 0.5 -> mean 0.75, std sqrt((0.0625 + 0 + 0.0625) / 2) = 0.25 -> 1, 0, -1
# A_conf answer 101: 0.96, 0.36, 0.36 -> mean 0.56, std sqrt((0.16 + 0.04 + 0.04) / 2) = 0.34641 -> 1.1547, -0.57735 x2
# A_conf answer 110: all 0.2 -> 0;  answer 111: 0.0, 0.6, 0.3 -> mean 0.3, std 0.3 -> -1, 1, 0
S = 1 / math.sqrt(2)
A_ANS = [S] * 3 + [-S] * 3 + [0.0] * 6
A_CONF = [1.0, 0.0, -1.0, 2 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), 0.0, 0.0, 0.0, -1.0, 1.0, 0.0]


def expected_tokens(a_ans, a_conf, first_only):
    rows = []
    for i in range(12):
        round1 = a_ans[i] if (FIRST_COPY[i] or not first_only) else 0.0
        round2 = [a_conf[i], a_conf[i] if i != 11 else 0.0]
        rows.append([round1, round1, *round2])
    return torch.tensor(rows, dtype=torch.float32)


@pytest.mark.parametrize("first_only", [True, False])
def test_segment_advantages_by_hand(first_only):
    advantage = MTPOAdvantage(GroupAdvantage.Config(use_std=True))
    got = advantage(make_batch(first_only))
    torch.testing.assert_close(got, expected_tokens(A_ANS, A_CONF, first_only), atol=1e-5, rtol=0)
    # prompt 11's two answers agree (1 of 2 prompts); answer 110's continuations agree (1 of 4 answers)
    assert advantage.metrics() == {"mtpo/answer_zero_std_fraction": 0.5, "mtpo/confidence_zero_std_fraction": 0.25}


def test_without_std_the_advantages_are_only_centred():
    # scale_rewards = false: A_ans +-0.5; A_conf 0.25, 0, -0.25 | 0.4, -0.2, -0.2 | 0 | -0.3, 0.3, 0
    a_ans = [0.5] * 3 + [-0.5] * 3 + [0.0] * 6
    a_conf = [0.25, 0.0, -0.25, 0.4, -0.2, -0.2, 0.0, 0.0, 0.0, -0.3, 0.3, 0.0]
    got = MTPOAdvantage(GroupAdvantage.Config(use_std=False))(make_batch(True))
    torch.testing.assert_close(got, expected_tokens(a_ans, a_conf, True), atol=1e-6, rtol=0)


def test_answer_baseline_counts_each_answer_once_whatever_its_rows():
    # answer 100 has 3 rows and answer 101 one: the baseline is still over the two answers
    got = answer_advantages(torch.tensor([1.5, 1.5, 1.5, 0.5]), torch.tensor([10, 10, 10, 10]),
                            torch.tensor([100, 100, 100, 101]), use_std=True, std_floor=1e-4)
    torch.testing.assert_close(got, torch.tensor([S, S, S, -S], dtype=torch.float64))


def test_first_confidence_only_denominators():
    # round-1 tokens counted once per answer: 4 answers x 2 tokens; round-2 tokens: 11 x 2 + 1
    loss = ClippedPGLoss(ClippedPGLoss.Config(agg_mode="token-mean"))
    counts = loss.global_counts(make_batch(True))
    assert (counts.tokens, counts.sequences) == (4 * 2 + 23, 12)
    counts = loss.global_counts(make_batch(False))
    assert (counts.tokens, counts.sequences) == (12 * 2 + 23, 12)
    # the token-mean loss at ratio 1 is -sum(A over counted tokens) / counted tokens
    batch = make_batch(True)
    batch.advantages = MTPOAdvantage(GroupAdvantage.Config())(batch)
    batch.old_logprobs = torch.zeros(12, 4)
    value, _ = loss(torch.zeros(12, 4), batch, loss.global_counts(batch))
    reference = expected_tokens(A_ANS, A_CONF, True).double()[batch.response_mask].sum() / 31
    assert float(value) == pytest.approx(-float(reference), abs=1e-6)
    # a masked copy's round-1 tokens do not count even where their advantage would be large
    batch.advantages[1, :2] = 1e6
    assert float(loss(torch.zeros(12, 4), batch, loss.global_counts(batch))[0]) == pytest.approx(float(value), abs=1e-6)


def test_rows_of_one_answer_must_agree():
    batch = make_batch(True)
    batch.answer_rewards[1] = 0.0
    with pytest.raises(ValueError, match="answer group 100 differ in their answer reward"):
        MTPOAdvantage(GroupAdvantage.Config())(batch)
    batch = make_batch(True)
    batch.group_ids[2] = 11
    with pytest.raises(ValueError, match="answer group 100 differ in their prompt group id"):
        MTPOAdvantage(GroupAdvantage.Config())(batch)
