"""MTPO's two rounds on the rollout engine: round 2 continues round 1's answers from the engine's kept
KV cache (only the tokens after the kept prefix are prefilled) and samples exactly what a fresh
prefill of prompt + answer samples."""

import pytest

from aligner_ext.data.loader import DataConfig, PromptLoader
from aligner_ext.data.types import PromptRow
from aligner_ext.experience.base import RolloutConfig
from aligner_ext.experience.two_round import TwoRoundSampling
from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.rollout import PREFIX_BLOCK, RolloutEngine, RolloutEngineConfig
from aligner_ext.models.tiny import TinyModelConfig, build_tiny_model
from aligner_ext.rewards.manager import RewardConfig, RewardManager

G, H, ANSWER_CAP = 2, 3, 40


@pytest.fixture
def rewards():
    manager = RewardManager(RewardConfig(num_workers=1))
    yield manager
    manager.close()


def rounds(engine, tokenizer, rewards, answer_stop: str):
    maker = TwoRoundSampling(TwoRoundSampling.Config(num_answer_generations=G, num_confidence_generations=H,
                                                     max_answer_length=ANSWER_CAP, max_confidence_length=8),
                             RolloutConfig(n=G * H), engine, rewards, tokenizer, seed=3)
    rows = [PromptRow(row_id=f"t:{i}", messages=[{"role": "user", "content": q}], data_source="short_qa",
                      ground_truth="red") for i, q in enumerate(["Which colour is the sky at noon?", "Name a fruit."])]
    draws = PromptLoader(rows, tokenizer, DataConfig(), batch_size=2, shuffle=False).next_batch()
    answer = SamplingParams(max_new_tokens=ANSWER_CAP, temperature=1.0, seed=7, stop=[answer_stop])
    confidence = SamplingParams(max_new_tokens=8, temperature=1.0, seed=8, stop=["</confidence>"], return_logprobs=True)
    return draws, maker.two_rounds(draws, G, H, answer, confidence)[0]


def test_round_two_prefills_only_past_the_kept_prefix_and_samples_as_a_fresh_prefill(tiny_tokenizer, rewards):
    tok = tiny_tokenizer
    model = build_tiny_model(tok, TinyModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                                  intermediate_size=128, seed=1)).eval()
    # A stop string that round 1 meets: a character from the middle of an answer sampled with the
    # same seed and no stop (a stop only cuts the same token stream short).
    engine = RolloutEngine(model, tok, RolloutEngineConfig())
    draws, unstopped = rounds(engine, tok, rewards, answer_stop="<never>")
    source = next(s.answer.token_ids for s in unstopped if s.answer.finish_reason == "length")
    stop = next(text for text in (tok.decode([token], skip_special_tokens=True) for token in source[20:]) if len(text) == 1)

    draws, samples = rounds(engine, tok, rewards, answer_stop=stop)
    closed = [s for s in samples if s.copy == 0 and s.confidence is not None]
    assert closed, "no round-1 answer met the stop string"
    # The kept prefix of each closed answer: its prompt and answer but the answer's last token, in whole
    # blocks; each closed answer's H copies are one prefill run.
    expected = sum((len(s.draw.prompt_ids) + len(s.answer.token_ids) - 1) // PREFIX_BLOCK * PREFIX_BLOCK for s in closed)
    assert engine.last_call["prefix_reused_tokens"] == expected > 0

    fresh = RolloutEngine(model, tok, RolloutEngineConfig(prefix_cache=False))
    _, reference = rounds(fresh, tok, rewards, answer_stop=stop)
    assert fresh.last_call["prefix_reused_tokens"] == 0
    assert [(s.answer.token_ids, s.confidence and s.confidence.token_ids) for s in samples] == \
        [(s.answer.token_ids, s.confidence and s.confidence.token_ids) for s in reference]
    for mine, theirs in zip(samples, reference):
        if mine.confidence:
            assert mine.confidence.logprobs == pytest.approx(theirs.confidence.logprobs, abs=1e-5)
