"""TwoRoundSampling (MTPO) through the real HF engine driven by a scripted model: stop strings in
both rounds, round 2 continuing the exact round-1 ids, nested group ids, segment ids, the
first-confidence-only mask and its denominators, segment rewards, the two-round evaluation, and
both rounds parked at a refit and resumed (partial rollouts), each token keeping its version."""

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from aligner_ext.config import load_config
from aligner_ext.data.loader import DataConfig, PromptLoader
from aligner_ext.data.templating import encode_prompt
from aligner_ext.data.types import PromptRow
from aligner_ext.experience.base import RolloutConfig
from aligner_ext.experience.two_round import TwoRoundSampling
from aligner_ext.generation.hf import HFEngineConfig, HFGenerationEngine
from aligner_ext.generation.resumable import ResumableEngine
from aligner_ext.losses.clipped_pg import ClippedPGLoss
from aligner_ext.rewards.manager import RewardConfig, RewardManager

# Round 1, by prompt and by row of the call (row % 2 = answer index). "XX" follows the stop string;
# SPECIAL is a special token, dropped when decoding: re-tokenising the text would lose it.
SPECIAL = "<|im_start|>"
ANSWERS = {
    "Q1": ["<think>t" + SPECIAL + "</think><answer>red</answer>XX", "<think>t</think><answer>blue</answer>"],
    "Q2": ["<answer>unknown</answer>", "<think>" + "z" * 60],  # well-formed but no think / never closes
}
# Round 2, by row of the call (row % 3 = copy index). "ZZ" follows the stop string.
CONFIDENCES = ["<analysis>a</analysis><confidence>0.8</confidence>ZZ", "<confidence>0.5</confidence>",
               "<analysis>a</analysis><confidence>high"]  # then EOS: unclosed, unparseable
MAX_ANSWER, MAX_CONFIDENCE = 40, 56


class ContextLM(nn.Module):
    """Called like a causal LM. Each row continues its prefill text with the tokens of
    `script(prefill_text, row)` one per step, then emits EOS; the "cache" holds the prefill text and the step."""

    def __init__(self, tokenizer, script):
        super().__init__()
        self.tokenizer, self.script, self.prefills = tokenizer, script, []

    def forward(self, input_ids, attention_mask, position_ids, past_key_values, use_cache):
        if past_key_values is None:
            texts = [self.tokenizer.decode(ids[mask.bool()].tolist()) for ids, mask in zip(input_ids, attention_mask)]
            self.prefills.append(texts)
            past_key_values = SimpleNamespace(texts=texts, step=0)
        else:
            past_key_values = SimpleNamespace(texts=past_key_values.texts, step=past_key_values.step + 1)
        logits = torch.zeros(len(input_ids), len(self.tokenizer))
        for row, text in enumerate(past_key_values.texts):
            continuation = self.tokenizer.encode(self.script(text, row))
            step = past_key_values.step
            logits[row, continuation[step] if step < len(continuation) else self.tokenizer.eos_token_id] = 30.0
        return SimpleNamespace(logits=logits[:, None, :].expand(-1, input_ids.shape[1], -1),
                               past_key_values=past_key_values)


def script(text, row):
    if text.endswith("</answer>"):
        return CONFIDENCES[row % 3]
    return ANSWERS["Q1" if "Q1" in text else "Q2"][row % 2]


class RecordingEngine(HFGenerationEngine):
    def generate(self, prompts, params):
        self.calls.append((prompts, params))
        return super().generate(prompts, params)


def qa_row(index, question, gold):
    return PromptRow(row_id=f"t:{index}", messages=[{"role": "user", "content": question}], data_source="short_qa",
                     ground_truth=gold)


@pytest.fixture
def rewards():
    manager = RewardManager(RewardConfig(num_workers=1))
    yield manager
    manager.close()


def make_maker(tokenizer, rewards, first_only=True, **rollout):
    engine = RecordingEngine(ContextLM(tokenizer, script), tokenizer, HFEngineConfig())
    engine.calls = []
    cfg = TwoRoundSampling.Config(num_answer_generations=2, num_confidence_generations=3,
                                  max_answer_length=MAX_ANSWER, max_confidence_length=MAX_CONFIDENCE,
                                  apply_answer_loss_on_first_confidence_only=first_only)
    return TwoRoundSampling(cfg, RolloutConfig(n=6, **rollout), engine, rewards, tokenizer, seed=3), engine


def loader_of(tokenizer, batch_size=2):
    rows = [qa_row(0, "Q1", "red"), qa_row(1, "Q2", "unknown")]
    return PromptLoader(rows, tokenizer, DataConfig(), batch_size=batch_size, shuffle=False)


def ids(tokenizer, text):
    return tokenizer.encode(text)


def test_two_rounds_stop_strings_exact_continuation_and_layout(tiny_tokenizer, rewards):
    tok = tiny_tokenizer
    maker, engine = make_maker(tok, rewards)
    batch, metrics = maker.make_experience(loader_of(tok), step=5)
    (round1_prompts, round1), (round2_prompts, round2) = engine.calls
    # round 1: G = 2 per draw, its own cap and stop string; round 2: H = 3 per closed answer
    assert (round1.max_new_tokens, round1.stop) == (MAX_ANSWER, ["</answer>"])
    assert (round2.max_new_tokens, round2.stop) == (MAX_CONFIDENCE, ["</confidence>"])
    assert round1.seed != round2.seed and len(round1_prompts) == 4
    # three answers closed (Q2's second hit the length cap): 3 x 3 continuations, each from the exact
    # round-1 ids ("XX" after the stop string was never part of them)
    answers = [ids(tok, "<think>t" + SPECIAL + "</think><answer>red</answer>"),
               ids(tok, "<think>t</think><answer>blue</answer>"),
               ids(tok, "<answer>unknown</answer>")]
    expected_round2 = [round1_prompts[i] + answer for i, answer in zip((0, 1, 2), answers) for _ in range(3)]
    assert round2_prompts == expected_round2
    assert len(batch) == 12
    assert batch.group_ids.tolist() == [0] * 6 + [1] * 6
    assert batch.answer_group_ids.tolist() == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3  # draw_id * G + answer
    confidences = [ids(tok, "<analysis>a</analysis><confidence>0.8</confidence>"),
                   ids(tok, "<confidence>0.5</confidence>"), ids(tok, CONFIDENCES[2]) + [tok.eos_token_id]]
    cut_answer = ids(tok, "<think>" + "z" * (MAX_ANSWER - 7))
    for i in range(12):
        answer = answers[i // 3] if i < 9 else cut_answer
        round2_ids = confidences[i % 3] if i < 9 else []
        length = len(answer) + len(round2_ids)
        assert batch.response_ids[i, :length].tolist() == answer + round2_ids
        assert batch.response_valid[i].sum() == length
        assert batch.segment_ids[i, :length].tolist() == [0] * len(answer) + [1] * len(round2_ids)
    assert [s.finish_reason for s in batch.samples] == ["stop", "stop", "eos"] * 3 + ["length"] * 3
    assert metrics["mtpo/answer_stop_found_ratio"] == 0.75
    assert metrics["mtpo/confidence_stop_found_ratio"] == pytest.approx(2 / 3)
    assert metrics["mtpo/answer_length_mean"] == pytest.approx((37 + 37 + 24 + 40) / 4)


def test_both_rounds_carry_rollout_ignore_eos(tiny_tokenizer, rewards):
    maker, _ = make_maker(tiny_tokenizer, rewards, ignore_eos=True)
    answer_params, confidence_params = maker.round_params(step=1)
    assert answer_params.ignore_eos and confidence_params.ignore_eos
    plain, _ = make_maker(tiny_tokenizer, rewards)
    assert not any(params.ignore_eos for params in plain.round_params(step=1))


def test_first_confidence_only_mask_and_denominators(tiny_tokenizer, rewards):
    tok = tiny_tokenizer
    round1 = [37, 37, 24, 40]  # tokens of the four round-1 answers (one character or special token each)
    round2 = [50, 28, 39]  # of the three continuations (the third ends with EOS) (the fourth answer has none)
    batch, _ = make_maker(tok, rewards)[0].make_experience(loader_of(tok), step=0)
    for i in range(12):
        answer_len = round1[i // 3]
        counted_round1 = batch.response_mask[i, :answer_len].sum().item()
        assert counted_round1 == (answer_len if i % 3 == 0 else 0)
        assert batch.response_mask[i, answer_len:].sum() == (round2[i % 3] if i < 9 else 0)
    counts = ClippedPGLoss(ClippedPGLoss.Config()).global_counts(batch)
    # round-1 tokens once per answer, round-2 tokens of every continuation; the two masked copies of
    # the unclosed answer hold no counted token and are no sequence
    assert counts.tokens == sum(round1) + 3 * sum(round2)
    assert counts.sequences == 12 - 2
    batch_all, _ = make_maker(tok, rewards, first_only=False)[0].make_experience(loader_of(tok), step=0)
    counts_all = ClippedPGLoss(ClippedPGLoss.Config()).global_counts(batch_all)
    assert counts_all.tokens == 3 * sum(round1) + 3 * sum(round2) and counts_all.sequences == 12


def test_segment_rewards_by_hand(tiny_tokenizer, rewards):
    batch, metrics = make_maker(tiny_tokenizer, rewards)[0].make_experience(loader_of(tiny_tokenizer), step=0)
    # answer side (correctness 1.0, format 0.5): red right and well-formed 1.5; blue wrong 0.5;
    # "unknown" right without think 1.0; the unclosed answer 0
    assert batch.answer_rewards.tolist() == [1.5] * 3 + [0.5] * 3 + [1.0] * 3 + [0.0] * 3
    assert batch.correct.tolist() == [1.0] * 3 + [0.0] * 3 + [1.0] * 3 + [0.0] * 3
    # confidence side (calibration 1.0, format 0.5): c = 0.8 well-formed; c = 0.5 without analysis;
    # "high" unparseable -> 0. Right answer: 0.96 + 0.5, 0.75, 0; wrong answer: 0.36 + 0.5, 0.75, 0
    right, wrong = [1.46, 0.75, 0.0], [0.86, 0.75, 0.0]
    torch.testing.assert_close(batch.confidence_rewards, torch.tensor(right + wrong + right + [0.0] * 3))
    torch.testing.assert_close(batch.rewards, batch.answer_rewards + batch.confidence_rewards)
    # each part sits on the last token of its own segment
    assert batch.token_rewards[0, 36] == pytest.approx(1.5) and batch.token_rewards[0, 86] == pytest.approx(1.46)
    assert batch.token_rewards[9, 39] == 0.0 and batch.token_rewards[0].count_nonzero() == 2
    info = batch.samples[1].reward_info
    assert (info["confidence"], info["answer_finish"], info["confidence_finish"]) == (0.5, "stop", "stop")
    assert batch.samples[2].reward_info["confidence_finish"] == "eos"
    assert batch.samples[0].response_text.endswith("</answer><analysis>a</analysis><confidence>0.8</confidence>")
    assert metrics["mtpo/valid_answer_ratio"] == 0.75 and metrics["mtpo/answer_format_ratio"] == 0.5
    assert metrics["mtpo/confidence_parsed_ratio"] == pytest.approx(2 / 3)


def test_evaluate_runs_both_rounds_greedily(tiny_tokenizer, rewards):
    maker, engine = make_maker(tiny_tokenizer, rewards)
    metrics = maker.evaluate(loader_of(tiny_tokenizer),
                             single_round=lambda loader: pytest.fail("single-round used"))
    (_, round1), (round2_prompts, round2) = engine.calls
    assert round1.temperature == 0 and round2.temperature == 0 and len(round2_prompts) == 1
    # Q1 -> row 0 -> "red" closed, then c = 0.8; Q2 -> row 1 -> never closes (confidence counted as 0)
    # confidences [0.8, 0], outcomes [1, 0]: Brier (0.04 + 0) / 2; ECE (0.2 + 0) / 2; AUROC 1
    assert metrics["val/accuracy"] == 0.5 and metrics["val/mean_confidence"] == pytest.approx(0.4)
    assert metrics["val/brier"] == pytest.approx(0.02) and metrics["val/ece"] == pytest.approx(0.1)
    assert metrics["val/auroc"] == 1.0
    assert metrics["val/confidence_parsed_ratio"] == 0.5 and metrics["val/num_prompts"] == 2
    assert metrics["val/reward_mean"] == pytest.approx((1.5 + 1.46 + 0.0) / 2)


def test_evaluation_where_no_confidence_is_stated_leaves_calibration_undefined(tiny_tokenizer, rewards):
    def unsure(text, row):  # every answer closes and is right; no confidence ever parses
        return "<confidence>high" if text.endswith("</answer>") else "<think>t</think><answer>red</answer>"

    engine = RecordingEngine(ContextLM(tiny_tokenizer, unsure), tiny_tokenizer, HFEngineConfig())
    engine.calls = []
    maker = TwoRoundSampling(TwoRoundSampling.Config(num_answer_generations=2, num_confidence_generations=3,
                                                     max_answer_length=MAX_ANSWER, max_confidence_length=MAX_CONFIDENCE),
                             RolloutConfig(n=6), engine, rewards, tiny_tokenizer, seed=3)
    rows = [qa_row(0, "Q1", "red"), qa_row(1, "Q2", "red")]
    metrics = maker.evaluate(PromptLoader(rows, tiny_tokenizer, DataConfig(), batch_size=2, shuffle=False),
                             single_round=lambda loader: pytest.fail("single-round used"))
    assert metrics["val/accuracy"] == 1.0 and metrics["val/confidence_parsed_ratio"] == 0.0
    for name in ("brier", "ece", "auroc", "mean_confidence"):  # not 0.000: nothing was calibrated
        assert math.isnan(metrics[f"val/{name}"]), name


class ParkedAt(HFGenerationEngine):
    """The HF engine whose k-th call stops after `park_after[k]` tokens (a refit wanted then, as the
    generation thread's engine sees it); records each call's prompts."""

    def __init__(self, *args, park_after):
        super().__init__(*args)
        self.park_after, self.prompts = park_after, []

    def generate(self, prompts, params, should_stop=None):
        polls, park_after = itertools.count(1), self.park_after.get(len(self.prompts))
        self.prompts.append(prompts)
        return super().generate(prompts, params, should_stop=lambda: next(polls) == park_after)


RESUMED_ANSWER, RESUMED_CONFIDENCE = "<answer>red</answer>XX", "<confidence>0.8</confidence>ZZ"


def resumed_script(text, row):
    """The rest of the round's text after what the prefill already holds of it (a resumed call's prefill
    ends with the response so far): a continuation that depends on the text alone, not on the row."""
    target = RESUMED_CONFIDENCE if "</answer>" in text else RESUMED_ANSWER
    written = max(k for k in range(len(target)) if text.endswith(target[:k]))
    return target[written:]


def test_rounds_parked_at_a_refit_keep_each_tokens_version_and_match_stop_strings_across_the_park(
        tiny_tokenizer, rewards):
    """Round 1 parks after 14 tokens, inside its stop string ("<answer>red</a" | "nswer>"), round 2 after 17,
    inside its own ("<confidence>0.8</" | "confidence>"); each refit adds a version. Every sample holds the
    answer's 20 tokens (14 of version 0, 6 of 1), then the confidence's 28 (17 of 1, 11 of 2)."""
    tok = tiny_tokenizer
    inner = ParkedAt(ContextLM(tok, resumed_script), tok, HFEngineConfig(), park_after={0: 14, 2: 17})
    engine = ResumableEngine(inner, tok)
    engine.await_refit = lambda: setattr(engine, "weights_version", engine.weights_version + 1)
    cfg = TwoRoundSampling.Config(num_answer_generations=2, num_confidence_generations=2,
                                  max_answer_length=MAX_ANSWER, max_confidence_length=MAX_CONFIDENCE)
    maker = TwoRoundSampling(cfg, RolloutConfig(n=4, return_logprobs=True), engine, rewards, tok, seed=3)
    loader = PromptLoader([qa_row(0, "Q1", "red")], tok, DataConfig(), batch_size=1, shuffle=False)
    batch, _ = maker.make_experience(loader, step=0)

    prompt = encode_prompt(tok, [{"role": "user", "content": "Q1"}])
    answer, confidence = ids(tok, "<answer>red</answer>"), ids(tok, "<confidence>0.8</confidence>")
    # each call resumes prompt + response so far; round 2 continues the whole answer, its stop found across the park
    assert inner.prompts == [[prompt] * 2, [prompt + answer[:14]] * 2, [prompt + answer] * 4,
                             [prompt + answer + confidence[:17]] * 4]
    assert [s.finish_reason for s in batch.samples] == ["stop"] * 4
    assert all(s.reward_info["answer_finish"] == "stop" for s in batch.samples)
    assert batch.response_ids.tolist() == [answer + confidence] * 4
    versions = [0] * 14 + [1] * 6 + [1] * 17 + [2] * 11
    assert batch.generation_versions.tolist() == [versions] * 4
    assert batch.segment_ids.tolist() == [[0] * 20 + [1] * 28] * 4
    assert batch.generation_logprobs.shape == (4, 48)


def test_configuration_errors(tiny_tokenizer, rewards):
    with pytest.raises(ValueError, match=r"rollout.n \(8\) must equal .* = 6"):
        TwoRoundSampling(TwoRoundSampling.Config(num_answer_generations=2, num_confidence_generations=3),
                         RolloutConfig(n=8), None, rewards, tiny_tokenizer)
    with pytest.raises(ValueError, match=r"rollout.stop \['x'\] is not used by two-round rollouts"):
        load_config("base", ["+variant=mtpo", "rollout.stop=[x]"])
    with pytest.raises(ValueError, match="mtpo.max_confidence_length"):
        TwoRoundSampling(TwoRoundSampling.Config(max_confidence_length=0), RolloutConfig(n=8), None, rewards,
                         tiny_tokenizer)
