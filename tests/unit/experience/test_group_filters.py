"""Dynamic sampling's group filters (experience/filters.py): keep plus a reason per group, and the
segment filter that lets dynamic sampling compose with MTPO."""

import pytest
import torch

from aligner_ext.batch import concat_batches
from aligner_ext.config import load_config
from aligner_ext.experience.filters import FILTERS, FilterResult
from test_dynamic_sampling import loader, wrap

SEGMENTS = FILTERS["segments"].predicate


def two_round_group(make_batch, group_id, answer_rewards, confidence_rewards, correct):
    """One prompt's G=2 answers x H=2 continuations, rows in (answer, copy) order: answer ids 2g, 2g+1."""
    batch = make_batch([[True]] * 4, group_ids=[group_id] * 4)
    batch.answer_group_ids = torch.tensor([2 * group_id] * 2 + [2 * group_id + 1] * 2)
    batch.answer_rewards = torch.tensor(answer_rewards)
    batch.confidence_rewards = torch.tensor(confidence_rewards)
    batch.correct = torch.tensor(correct)
    batch.segment_ids = torch.zeros(4, 1, dtype=torch.long)
    batch.rewards = batch.answer_rewards + batch.confidence_rewards
    batch.token_rewards = batch.rewards[:, None].clone()
    return batch


def test_answers_agree_but_one_answers_confidences_differ_so_the_group_is_kept(make_batch):
    # both answers right and well formed (R_ans = 1 + 0.5 = 1.5 each): no answer signal, and the
    # correctness filter drops the group as all correct. Answer 0's continuations said c = 0.5 and
    # c = 1.0: R_conf = 1 - (c - 1)^2 + 0.5 = 1.25 and 1.5, a spread of 0.25 > eps: they train.
    group = two_round_group(make_batch, 0, [1.5, 1.5, 1.5, 1.5], [1.25, 1.5, 1.5, 1.5], [1.0, 1.0, 1.0, 1.0])
    assert SEGMENTS(group, 1e-6) == FilterResult(True, "confidence_only")
    assert FILTERS["correct"].predicate(group, 1e-6) == FilterResult(False, "all_correct")


def test_both_segments_agree_so_the_group_is_dropped(make_batch):
    # both answers wrong and well formed (R_ans = 0 + 0.5), and every continuation said c = 0:
    # R_conf = 1 - (0 - 0)^2 + 0.5 = 1.5 everywhere. Neither segment has anything to learn.
    group = two_round_group(make_batch, 0, [0.5, 0.5, 0.5, 0.5], [1.5, 1.5, 1.5, 1.5], [0.0, 0.0, 0.0, 0.0])
    assert SEGMENTS(group, 1e-6) == FilterResult(False, "segments_agree")


def test_answers_that_differ_keep_the_group_whatever_the_confidences(make_batch):
    group = two_round_group(make_batch, 0, [1.5, 1.5, 0.5, 0.5], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0])
    assert SEGMENTS(group, 1e-6) == FilterResult(True, "answer_spread")
    # a spread at or below eps is no spread: 1.5 vs 1.5 + 1e-7
    group = two_round_group(make_batch, 0, [1.5, 1.5, 1.5000001, 1.5000001], [1.0] * 4, [1.0] * 4)
    assert SEGMENTS(group, 1e-6) == FilterResult(False, "segments_agree")


class ScriptedTwoRound:
    """Each draw becomes the next scripted (answer rewards, confidence rewards) group."""

    summary_metrics = ()

    def __init__(self, make_batch, groups):
        self.make_batch, self.groups = make_batch, list(groups)

    def make_experience(self, stream, step):
        draws = stream.next_batch()
        parts = [two_round_group(self.make_batch, d.draw_id, *self.groups.pop(0), [1.0] * 4) for d in draws]
        return concat_batches(parts, pad_token_id=0), {}


def test_dynamic_sampling_counts_each_segment_verdict(make_batch, tiny_tokenizer):
    agreeing = ([1.5] * 4, [1.0] * 4)
    confidence_only = ([1.5] * 4, [1.25, 1.5, 1.5, 1.5])
    answers_differ = ([1.5, 1.5, 0.5, 0.5], [1.0] * 4)
    inner = ScriptedTwoRound(make_batch, [agreeing, confidence_only, answers_differ, agreeing])
    batch, metrics = wrap(inner, max_gen_batches=1, filter_metric="segments").make_experience(
        loader(tiny_tokenizer, batch_size=4), step=0)
    assert batch.group_ids.tolist() == [1] * 4 + [2] * 4
    assert metrics["dynamic_sampling/kept_confidence_only"] == 1
    assert metrics["dynamic_sampling/kept_answer_spread"] == 1
    assert metrics["dynamic_sampling/dropped_segments_agree"] == 2
    assert metrics["dynamic_sampling/kept_groups"] == 2 and metrics["dynamic_sampling/filtered_fraction"] == 0.5


def test_with_mtpo_the_default_filter_becomes_the_segment_filter():
    cfg = load_config("base", ["+variant=[dapo,mtpo]"])
    assert cfg.dynamic_sampling.filter_metric == "segments"
    assert load_config("base", ["+variant=dapo"]).dynamic_sampling.filter_metric == "correct"
    with pytest.raises(ValueError, match="filter_metric=seq_reward sums MTPO's answer and confidence rewards"):
        load_config("base", ["+variant=[dapo,mtpo]", "dynamic_sampling.filter_metric=seq_reward"])
