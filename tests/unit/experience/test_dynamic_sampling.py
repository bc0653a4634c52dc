"""Dynamic sampling (DAPO): group filter, refill sizes, bound policies, surplus, checkpoint state."""

import io
import logging
from types import SimpleNamespace

import pytest
import torch

from aligner_ext.batch import ExperienceBatch, SampleInfo
from aligner_ext.config import RunConfig, load_config
from aligner_ext.data.loader import DataConfig, PromptLoader
from aligner_ext.data.types import PromptRow
from aligner_ext.experience.base import ExperienceMaker, GroupSampling, RolloutConfig
from aligner_ext.experience.dynamic_sampling import DynamicSampling, DynamicSamplingConfig
from aligner_ext.generation.base import GenerationEngine, GenerationOutput
from aligner_ext.rewards.manager import RewardConfig, RewardManager

N = 3  # samples per prompt


class ScriptedMaker(ExperienceMaker):
    """Each prompt draw gets the next scripted outcome list (one value per sample)."""

    def __init__(self, outcomes):
        self.outcomes = list(outcomes)
        self.requests = []  # prompts asked for per call

    def make_experience(self, loader, step):
        draws = loader.next_batch()
        self.requests.append(len(draws))
        rows = [(draw, self.outcomes.pop(0)) for draw in draws]
        size = len(rows) * N
        correct = torch.tensor([value for _, values in rows for value in values], dtype=torch.float32)
        return ExperienceBatch(
            prompt_ids=torch.ones(size, 2, dtype=torch.long), prompt_mask=torch.ones(size, 2, dtype=torch.bool),
            response_ids=torch.ones(size, 1, dtype=torch.long), response_valid=torch.ones(size, 1, dtype=torch.bool),
            response_mask=torch.ones(size, 1, dtype=torch.bool),
            group_ids=torch.tensor([draw.draw_id for draw, _ in rows for _ in range(N)]),
            samples=[SampleInfo(row=draw.row) for draw, _ in rows for _ in range(N)],
            rewards=correct.clone(), correct=correct, token_rewards=correct.clone()[:, None],
        ), {"reward/num_errors": 1.0, "reward/fallback_fraction": 0.5}


def loader(tokenizer, rows=20, batch_size=3):
    data = [PromptRow(row_id=f"t:{i}", messages=[{"role": "user", "content": f"q{i}"}], data_source="t",
                      ground_truth="1") for i in range(rows)]
    return PromptLoader(data, tokenizer, DataConfig(), batch_size=batch_size, shuffle=False)


def wrap(inner, max_gen_batches=0, **cfg):
    return DynamicSampling(inner, DynamicSamplingConfig(max_gen_batches=max_gen_batches, **cfg), pad_token_id=0)


MIXED, ALL_RIGHT, ALL_WRONG = [1, 0, 1], [1, 1, 1], [0, 0, 0]


def test_keeps_only_groups_with_mixed_outcomes_and_counts_drop_reasons(tiny_tokenizer):
    maker = wrap(ScriptedMaker([ALL_RIGHT, MIXED, ALL_WRONG, [0, 0, 1]]), max_gen_batches=1)
    batch, metrics = maker.make_experience(loader(tiny_tokenizer, batch_size=4), step=0)
    assert sorted(set(batch.group_ids.tolist())) == [1, 3]  # draws 1 and 3 have mixed outcomes
    assert len(batch) == 2 * N
    assert metrics["dynamic_sampling/dropped_all_correct"] == 1
    assert metrics["dynamic_sampling/dropped_all_wrong"] == 1
    assert metrics["dynamic_sampling/filtered_fraction"] == 0.5
    assert metrics["dynamic_sampling/num_accumulated_prompts"] == 2
    assert metrics["dynamic_sampling/target_prompt_num"] == 4


def test_refills_only_the_missing_groups_until_the_batch_is_full(tiny_tokenizer):
    inner = ScriptedMaker([ALL_RIGHT, MIXED, ALL_WRONG,   # batch 1: 3 asked, 1 kept
                           MIXED, ALL_WRONG,              # batch 2: 2 asked, 1 kept
                           MIXED])                        # batch 3: 1 asked, 1 kept
    batch, metrics = wrap(inner).make_experience(loader(tiny_tokenizer), step=0)
    assert inner.requests == [3, 2, 1]
    assert batch.group_ids.tolist() == [1] * N + [3] * N + [5] * N  # arrival order, whole groups
    assert metrics["dynamic_sampling/num_gen_batches"] == 3
    assert metrics["dynamic_sampling/generated_groups"] == 6
    # counts from the inner maker add up over generation batches, other values are averaged
    assert metrics["reward/num_errors"] == 3 and metrics["reward/fallback_fraction"] == 0.5


def test_bound_reached_trains_on_what_was_kept_by_default(tiny_tokenizer, caplog):
    inner = ScriptedMaker([ALL_RIGHT, MIXED, ALL_WRONG, ALL_WRONG, ALL_RIGHT])
    with caplog.at_level(logging.WARNING):
        batch, metrics = wrap(inner, max_gen_batches=2).make_experience(loader(tiny_tokenizer), step=7)
    assert inner.requests == [3, 2]
    assert batch.group_ids.tolist() == [1] * N
    assert "training on the 1 kept groups" in caplog.text


def test_bound_reached_can_stop_with_an_actionable_error(tiny_tokenizer):
    maker = wrap(ScriptedMaker([ALL_RIGHT] * 6), max_gen_batches=2, on_max_gen_batches="error")
    with pytest.raises(RuntimeError, match="raise dynamic_sampling.max_gen_batches"):
        maker.make_experience(loader(tiny_tokenizer), step=0)


def test_every_group_filtered_gives_an_empty_batch_and_a_warning(tiny_tokenizer, caplog):
    maker = wrap(ScriptedMaker([ALL_WRONG] * 6), max_gen_batches=2)
    with caplog.at_level(logging.WARNING):
        batch, metrics = maker.make_experience(loader(tiny_tokenizer), step=0)
    assert len(batch) == 0
    assert metrics["dynamic_sampling/filtered_fraction"] == 1.0
    assert "no update" in caplog.text


def test_accumulation_crosses_the_epoch_boundary(tiny_tokenizer):
    stream = loader(tiny_tokenizer, rows=4, batch_size=3)
    inner = ScriptedMaker([ALL_WRONG, ALL_WRONG, MIXED, ALL_WRONG, MIXED, MIXED])
    batch, _ = wrap(inner).make_experience(stream, step=0)
    # draws 0-2 (1 kept), then 3 and 4 (4 is row 0 again, in epoch 1), then 5
    assert inner.requests == [3, 2, 1]
    assert sorted(set(batch.group_ids.tolist())) == [2, 4, 5]
    assert stream.epoch == 1
    assert [s.row.row_id for s in batch.samples[N::N]] == ["t:0", "t:1"]


def test_filters_on_the_raw_outcome_not_on_a_shaped_reward(tiny_tokenizer):
    inner = ScriptedMaker([ALL_WRONG, MIXED, MIXED, MIXED])
    original = inner.make_experience

    def shaped(stream, step):  # shaping makes the all-wrong group's rewards differ
        batch, metrics = original(stream, step)
        batch.rewards = batch.rewards + torch.arange(len(batch), dtype=torch.float32) * 0.1
        batch.token_rewards = batch.rewards[:, None].clone()
        return batch, metrics

    inner.make_experience = shaped
    batch, _ = wrap(inner).make_experience(loader(tiny_tokenizer), step=0)
    assert 0 not in batch.group_ids.tolist()
    inner_seq = ScriptedMaker([ALL_WRONG, MIXED, MIXED])
    inner_seq.make_experience = lambda stream, step, f=inner_seq.make_experience: shaped_seq(f, stream, step)
    batch, _ = wrap(inner_seq, filter_metric="seq_reward").make_experience(loader(tiny_tokenizer), step=0)
    assert 0 in batch.group_ids.tolist()  # on the summed token scores the shaped group differs


def shaped_seq(make, stream, step):
    batch, metrics = make(stream, step)
    batch.token_rewards = (batch.rewards + torch.arange(len(batch)) * 0.1)[:, None]
    return batch, metrics


def test_surplus_is_carried_saved_and_restored(tiny_tokenizer):
    # oversample 2: the first batch asks 6 prompts for a target of 3; 4 are mixed, so 1 is surplus
    first = wrap(ScriptedMaker([MIXED, MIXED, ALL_WRONG, MIXED, MIXED, ALL_RIGHT]), oversample=2.0,
                 keep_surplus=True)
    stream = loader(tiny_tokenizer)
    batch, metrics = first.make_experience(stream, step=0)
    assert sorted(set(batch.group_ids.tolist())) == [0, 1, 3]
    assert metrics["dynamic_sampling/surplus_carried"] == 1

    buffer = io.BytesIO()
    torch.save({"maker": first.state_dict(), "loader": stream.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    resumed = wrap(ScriptedMaker([MIXED, MIXED, MIXED, MIXED]), oversample=2.0, keep_surplus=True)
    resumed.load_state_dict(saved["maker"])
    stream2 = loader(tiny_tokenizer)
    stream2.load_state_dict(saved["loader"])
    batch, metrics = resumed.make_experience(stream2, step=1)
    # the carried group (draw 4) comes first, then 2 missing groups: ceil(2 * 2) = 4 prompts drawn
    assert resumed.inner.requests == [4]
    assert batch.group_ids.tolist()[:N] == [4] * N
    assert sorted(set(batch.group_ids.tolist())) == [4, 6, 7]
    assert metrics["dynamic_sampling/surplus_carried"] == 2


def test_carried_groups_expire_after_max_surplus_age(tiny_tokenizer):
    maker = wrap(ScriptedMaker([MIXED] * 8), oversample=2.0, keep_surplus=True, max_surplus_age=1)
    stream = loader(tiny_tokenizer, batch_size=2)
    maker.make_experience(stream, step=0)  # 4 asked, 2 kept, 2 carried (born at step 0)
    batch, metrics = maker.make_experience(stream, step=5)
    assert metrics["dynamic_sampling/surplus_expired"] == 2
    assert sorted(set(batch.group_ids.tolist())) == [4, 5]  # fresh draws only; 2 and 3 were too old


def context(**settings):
    cfg = RunConfig()
    for key, value in settings.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return SimpleNamespace(cfg=cfg, tokenizer=SimpleNamespace(pad_token_id=0))


def test_switched_off_it_leaves_the_maker_untouched():
    inner = ScriptedMaker([])
    assert DynamicSampling.from_context(inner, context()) is inner
    assert isinstance(DynamicSampling.from_context(inner, context(dynamic_sampling__enabled=True)),
                      DynamicSampling)


def test_one_sample_per_prompt_is_refused_when_the_config_loads():
    with pytest.raises(ValueError, match="dynamic_sampling.enabled needs rollout.n >= 2"):
        load_config("base", ["+variant=dapo", "rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus"])


class AnswerEngine(GenerationEngine):
    """Answers "a+b=" prompts: right for even draws' first sample only, so groups mix or all fail."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts = tokenizer, texts

    def generate(self, prompts, params):
        return [GenerationOutput(self.tokenizer(self.texts.pop(0), add_special_tokens=False)["input_ids"], "eos")
                for _ in prompts]


def test_composes_with_group_sampling_and_real_rewards(tiny_tokenizer):
    rows = [PromptRow(row_id=f"t:{i}", messages=[{"role": "user", "content": f"{i}+1="}],
                      data_source="arithmetic", ground_truth=str(i + 1)) for i in range(6)]
    stream = PromptLoader(rows, tiny_tokenizer, DataConfig(), batch_size=2, shuffle=False)
    # prompt 0: "1" right, "9" wrong -> mixed; prompt 1: both wrong; then prompt 2: "3" right, "0" wrong
    texts = ["\\boxed{1}", "\\boxed{9}", "\\boxed{9}", "\\boxed{9}", "\\boxed{3}", "\\boxed{0}"]
    with RewardManager(RewardConfig(num_workers=1)) as rewards:
        inner = GroupSampling(RolloutConfig(n=2), AnswerEngine(tiny_tokenizer, texts), rewards, tiny_tokenizer)
        batch, metrics = wrap(inner).make_experience(stream, step=0)
    assert batch.group_ids.tolist() == [0, 0, 2, 2]
    assert batch.correct.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert [s.row.row_id for s in batch.samples] == ["t:0", "t:0", "t:2", "t:2"]
    assert metrics["dynamic_sampling/dropped_all_wrong"] == 1


def test_evaluation_and_state_go_through_to_the_wrapped_maker():
    class OwnEvaluation(ScriptedMaker):
        def evaluate(self, loader, single_round):
            return {"val/own": 1.0}

        def state_dict(self):
            return {"cursor": 7}

        def load_state_dict(self, state):
            self.loaded = state

    maker = wrap(OwnEvaluation([]))
    assert maker.evaluate(None, single_round=lambda loader: {"val/single": 0.0}) == {"val/own": 1.0}
    state = maker.state_dict()
    assert state["inner"] == {"cursor": 7}
    maker.load_state_dict(state)
    assert maker.inner.loaded == {"cursor": 7}
