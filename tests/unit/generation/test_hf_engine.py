"""HFGenerationEngine on the tiny random-weight model, against references that re-run the full
sequence without a cache at every step."""

import pytest
import torch

from aligner_ext.generation.base import ENGINES, SamplingParams
from aligner_ext.generation.hf import HFEngineConfig, HFGenerationEngine

PROMPTS = ["What is 2+2?", "hi", "Name a colour.", "x"]


@pytest.fixture
def model(tiny_model):
    """The tiny model with its block matrices redrawn at std 0.3: at the default init, greedy decoding
    just repeats the prompt's last token, which would hide cache and position errors."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in tiny_model.model.layers.parameters():
            if weight.dim() == 2:
                weight.normal_(0.0, 0.3, generator=generator)
    return tiny_model


def encode_all(tokenizer, texts):
    return [tokenizer.encode(text) for text in texts]


def reference_greedy(model, prompt, max_new_tokens, eos_id):
    """Greedy decoding that re-runs the whole unpadded sequence each step (no cache)."""
    sequence, generated = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(input_ids=torch.tensor([sequence])).logits[0, -1]
            token = int(logits.argmax())
            sequence.append(token)
            generated.append(token)
            if token == eos_id:
                break
    return generated


def full_forward_log_softmax(model, prompt, response, temperature):
    """[R, V] float64 log-softmax(logits / T) at the positions that predict each response token."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].double()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(response)] / temperature, dim=-1)


def test_registered_as_hf():
    assert ENGINES.get("hf") is HFGenerationEngine


@pytest.mark.parametrize("batch_size", [2, 8])
def test_greedy_with_cache_matches_uncached_reference(model, tiny_tokenizer, batch_size):
    prompts = encode_all(tiny_tokenizer, PROMPTS)
    engine = HFGenerationEngine(model, tiny_tokenizer, HFEngineConfig(batch_size=batch_size))
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    outputs = engine.generate(prompts, params)
    assert len(outputs) == len(prompts)
    for prompt, output in zip(prompts, outputs):
        expected = reference_greedy(model, prompt, 8, tiny_tokenizer.eos_token_id)
        assert output.token_ids == expected
        assert output.finish_reason == ("eos" if expected[-1] == tiny_tokenizer.eos_token_id else "length")
        assert engine.generate([prompt], params)[0].token_ids == expected  # alone == in a padded batch


def test_the_prompt_forward_is_a_multiple_of_16_columns_wide(model, tiny_tokenizer, widths_padded_on_the_cpu):
    """Prompts of 12 and 2 tokens, then of 19: prompt forwards of 16 and 32 columns (a new prompt width
    compiles no Triton kernel, aligner_ext/widths.py), the tokens still the unpadded reference's."""
    prompts = encode_all(tiny_tokenizer, ["What is 2+2?", "hi", "Name a colour, any."])
    assert [len(prompt) for prompt in prompts] == [12, 2, 19]  # one token per character
    widths = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]),
                                           with_kwargs=True)
    engine = HFGenerationEngine(model, tiny_tokenizer, HFEngineConfig())
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    outputs = engine.generate(prompts[:2], params) + engine.generate(prompts[2:], params)
    hook.remove()
    assert [width for width in widths if width > 1] == [16, 32]  # the decode steps feed one column
    for prompt, output in zip(prompts, outputs):
        assert output.token_ids == reference_greedy(model, prompt, 4, tiny_tokenizer.eos_token_id)


def test_greedy_logprobs_are_temperature_one_log_softmax(model, tiny_tokenizer):
    prompts = encode_all(tiny_tokenizer, PROMPTS[:2])
    engine = HFGenerationEngine(model, tiny_tokenizer, HFEngineConfig())
    params = SamplingParams(max_new_tokens=5, temperature=0.0, return_logprobs=True)
    outputs = engine.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        log_probs = full_forward_log_softmax(model, prompt, output.token_ids, temperature=1.0)
        expected = log_probs[torch.arange(len(output.token_ids)), output.token_ids]
        got = torch.tensor(output.logprobs, dtype=torch.float64)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_sampled_logprobs_match_full_forward(model, tiny_tokenizer):
    prompts = encode_all(tiny_tokenizer, PROMPTS)
    engine = HFGenerationEngine(model, tiny_tokenizer, HFEngineConfig())
    params = SamplingParams(max_new_tokens=6, temperature=0.7, top_p=1.0, return_logprobs=True, seed=3)
    for prompt, output in zip(prompts, engine.generate(prompts, params)):
        assert len(output.logprobs) == len(output.token_ids)
        log_probs = full_forward_log_softmax(model, prompt, output.token_ids, temperature=0.7)
        expected = log_probs[torch.arange(len(output.token_ids)), output.token_ids]
        got = torch.tensor(output.logprobs, dtype=torch.float64)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_logprobs_absent_unless_requested(model, tiny_tokenizer):
    engine = HFGenerationEngine(model, tiny_tokenizer, HFEngineConfig())
    output = engine.generate(encode_all(tiny_tokenizer, ["hi"]), SamplingParams(max_new_tokens=2))[0]
    assert output.logprobs is None


def test_max_new_tokens_is_respected(model, tiny_tokenizer):
    engine = HFGenerationEngine(model, tiny_tokenizer, HFEngineConfig())
    outputs = engine.generate(encode_all(tiny_tokenizer, PROMPTS), SamplingParams(max_new_tokens=3, seed=0))
    for output in outputs:
        assert len(output.token_ids) <= 3
        if output.finish_reason == "length":
            assert len(output.token_ids) == 3


def test_weights_are_shared_not_copied(model, tiny_tokenizer):
    prompts = encode_all(tiny_tokenizer, PROMPTS[:2])
    engine = HFGenerationEngine(model, tiny_tokenizer, HFEngineConfig())
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    before = engine.generate(prompts, params)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(-3.0)  # in place, as an optimizer step would
    after = engine.generate(prompts, params)
    for prompt, new in zip(prompts, after):
        expected = reference_greedy(model, prompt, 4, tiny_tokenizer.eos_token_id)
        assert new.token_ids == expected
    assert [o.token_ids for o in before] != [o.token_ids for o in after]


def test_train_mode_is_restored(model, tiny_tokenizer):
    model.train()
    engine = HFGenerationEngine(model, tiny_tokenizer, HFEngineConfig())
    engine.generate(encode_all(tiny_tokenizer, ["hi"]), SamplingParams(max_new_tokens=2))
    assert model.training
    model.eval()
    engine.generate(encode_all(tiny_tokenizer, ["hi"]), SamplingParams(max_new_tokens=2))
    assert not model.training


def test_empty_prompt_list_gives_empty_list(model, tiny_tokenizer):
    engine = HFGenerationEngine(model, tiny_tokenizer, HFEngineConfig())
    assert engine.generate([], SamplingParams()) == []


@pytest.mark.parametrize(
    ("prompts", "params", "message"),
    [
        ([[5], []], SamplingParams(), "prompt 1 is empty"),
        ([[5]], SamplingParams(max_new_tokens=0), "max_new_tokens"),
        ([[5]], SamplingParams(temperature=-1.0), "temperature"),
        # logits / 1e-40 overflow to inf: NaN log-probs, where 0 asks for greedy decoding
        ([[5]], SamplingParams(temperature=1e-40), r"temperature must be 0 \(greedy\) or >= 1e-05, got 1e-40"),
        ([[5]], SamplingParams(top_p=0.0), "top_p"),
        ([[5]], SamplingParams(stop=[""]), "stop string 0"),
    ],
)
def test_bad_requests_are_rejected(model, tiny_tokenizer, prompts, params, message):
    engine = HFGenerationEngine(model, tiny_tokenizer, HFEngineConfig())
    with pytest.raises(ValueError, match=message):
        engine.generate(prompts, params)
