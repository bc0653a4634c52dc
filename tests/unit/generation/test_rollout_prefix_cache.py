"""The rollout engine's kept KV cache (`prefix_cache`): a call whose prompts extend the sequences of
the call before it (MTPO's round 2: prompt + answer + more) copies their K/V and prefills only the
new tokens, and continues exactly as a fresh prefill would; the kept cache is never used after the
weights change or after `release_memory`."""

import pytest
import torch

from aligner_ext.generation.base import SamplingParams
from aligner_ext.generation.hf import HFEngineConfig, HFGenerationEngine
from aligner_ext.generation.rollout import PREFIX_BLOCK, RolloutEngine, RolloutEngineConfig
from aligner_ext.models.tiny import TinyModelConfig, build_tiny_model

ANSWER_TOKENS = 12
FIRST = SamplingParams(max_new_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True)
SECOND = SamplingParams(max_new_tokens=10, temperature=0.0, return_logprobs=True)


@pytest.fixture
def model(tiny_tokenizer):
    shape = TinyModelConfig(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=128, seed=1)
    return build_tiny_model(tiny_tokenizer, shape).eval()


def first_prompts(tokenizer):
    return [tokenizer.encode(text) for text in ("What is the capital of France?", "What is 2+2, please?", "Name a colour please, now.")]


def second_prompts(tokenizer, prompts, answers, copies=2):
    """Each prompt + its answer + a question, `copies` times (MTPO's H continuations)."""
    question = tokenizer.encode(" Confidence:")
    return [prompt + answer.token_ids + question for prompt, answer in zip(prompts, answers) for _ in range(copies)]


def reusable(prompt_length: int, second_prompt_length: int) -> int:
    """Tokens of a second prompt found in the kept cache: the first call's prompt and answer but the
    answer's last token (never fed back), in whole blocks, leaving the prompt's last token to prefill."""
    kept = prompt_length + ANSWER_TOKENS - 1
    return min(kept, second_prompt_length - 1) // PREFIX_BLOCK * PREFIX_BLOCK


def assert_same_outputs(outputs, expected):
    assert [o.token_ids for o in outputs] == [e.token_ids for e in expected]
    assert [o.finish_reason for o in outputs] == [e.finish_reason for e in expected]
    for output, reference in zip(outputs, expected):
        assert output.logprobs == pytest.approx(reference.logprobs, abs=1e-5)


def test_a_second_round_continues_from_the_kept_cache_as_a_fresh_prefill_would(tiny_tokenizer, model):
    tok = tiny_tokenizer
    prompts = first_prompts(tok)
    engine = RolloutEngine(model, tok, RolloutEngineConfig())
    answers = engine.generate(prompts, FIRST)
    second = second_prompts(tok, prompts, answers)
    outputs = engine.generate(second, SECOND)

    expected = HFGenerationEngine(model, tok, HFEngineConfig()).generate(second, SECOND)
    assert_same_outputs(outputs, expected)
    # the two copies of a prompt are one prefill run (share_prompt_prefill); each run reuses its prefix
    reused = [reusable(len(prompt), len(second[2 * i])) for i, prompt in enumerate(prompts)]
    assert min(reused) > 0
    assert engine.last_call["prefix_reused_tokens"] == sum(reused)
    assert engine.last_call["prefilled_tokens"] == sum(len(second[2 * i]) for i in range(len(prompts))) - sum(reused)


def test_with_fewer_slots_only_the_sequences_still_in_a_slot_are_kept(tiny_tokenizer, model):
    tok = tiny_tokenizer
    prompts = first_prompts(tok) + [tok.encode("One more prompt that is long enough.")]
    engine = RolloutEngine(model, tok, RolloutEngineConfig(max_batch_size=2))
    answers = engine.generate(prompts, FIRST)
    second = second_prompts(tok, prompts, answers, copies=1)
    outputs = engine.generate(second, SECOND)

    assert_same_outputs(outputs, RolloutEngine(model, tok, RolloutEngineConfig(prefix_cache=False)).generate(second, SECOND))
    # every answer has the same length, so requests 0, 1 take slots 0, 1 and then leave them to 2, 3
    assert engine.last_call["prefix_reused_tokens"] == sum(reusable(len(prompts[i]), len(second[i])) for i in (2, 3))


def perturb(model):
    torch.manual_seed(3)
    with torch.no_grad():  # an optimizer step, in place
        for parameter in model.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))


@pytest.mark.parametrize("between_calls", ["weights change", "release_memory"])
def test_the_kept_cache_is_dropped_when_the_weights_change_or_memory_is_released(tiny_tokenizer, model, between_calls):
    tok = tiny_tokenizer
    prompts = first_prompts(tok)
    engine = RolloutEngine(model, tok, RolloutEngineConfig())
    second = second_prompts(tok, prompts, engine.generate(prompts, FIRST))
    if between_calls == "weights change":
        perturb(model)
    else:
        engine.release_memory()
    outputs = engine.generate(second, SECOND)

    assert engine.last_call["prefix_reused_tokens"] == 0
    assert_same_outputs(outputs, HFGenerationEngine(model, tok, HFEngineConfig()).generate(second, SECOND))


def test_prompts_that_extend_nothing_kept_prefill_whole(tiny_tokenizer, model):
    tok = tiny_tokenizer
    engine = RolloutEngine(model, tok, RolloutEngineConfig())
    engine.generate(first_prompts(tok), FIRST)
    others = [tok.encode("A different prompt altogether, long enough for blocks.")]
    engine.generate(others, SECOND)
    assert engine.last_call["prefix_reused_tokens"] == 0
    assert engine.last_call["prefilled_tokens"] == len(others[0])
