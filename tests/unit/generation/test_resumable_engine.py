"""Partial rollouts (generation/resumable.py): a call parked at a refit resumes under the new weights, each
token keeping the log-prob and version of the weights that sampled it, with no key or value of the old
weights serving a resumed token (behaviour log-probs against a float64 forward of each version's weights
over prompt + response); the hand-over to the resumption (prompts, budget, seed, finishes, stop strings
that straddle the park) with a scripted engine."""

import copy
from types import SimpleNamespace

import pytest
import torch

from aligner_ext.generation.base import GenerationEngine, GenerationOutput, SamplingParams
from aligner_ext.generation.hf import HFEngineConfig, HFGenerationEngine
from aligner_ext.generation.resumable import ResumableEngine
from aligner_ext.generation.rollout import RolloutEngine, RolloutEngineConfig
from aligner_ext.generation.sampler import request_seed

# longer than the rollout engine's prefix blocks (16 tokens): a kept K/V cache of them would be reused
TEXTS = ["what is two plus two, then?", "name a colour of the sky.", "count: 1 2 3 4 5 6 7 8 9 10"]
PARAMS = SamplingParams(max_new_tokens=8, temperature=1.0, return_logprobs=True, seed=5, ignore_eos=True)


class RefitAt:
    """Asks for a refit at the `at`-th poll of the engine's first call; the refit copies `new` into the
    engine's model in place (as the generation copy is refitted) and moves its version to 1."""

    def __init__(self, engine: ResumableEngine, model, new, at: int):
        self.engine, self.model, self.new, self.at, self.polls = engine, model, new, at, 0
        engine.refit_wanted, engine.await_refit = self.wanted, self.refit

    def wanted(self) -> bool:
        self.polls += 1
        return self.engine.weights_version == 0 and self.polls >= self.at

    @torch.no_grad()
    def refit(self) -> None:
        for mine, theirs in zip(self.model.parameters(), self.new.parameters()):
            mine.copy_(theirs)
        self.engine.weights_version = 1


def updated(model):
    """The weights after an update: every parameter moved, so the two versions' log-probs differ plainly."""
    new = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in new.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    return new


def reference_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Float64 log-probs of `response` after `prompt` at temperature 1, from one forward without a cache."""
    wide = copy.deepcopy(model).double()
    with torch.no_grad():
        logits = wide(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.mark.parametrize("engine_name", ["hf", "rollout"])
def test_a_parked_response_resumes_under_the_new_weights_with_its_versions_and_logprobs(
        tiny_tokenizer, tiny_model, engine_name):
    old, new = copy.deepcopy(tiny_model), updated(tiny_model)
    generating = copy.deepcopy(tiny_model)  # the generation copy, refitted in place
    inner = (HFGenerationEngine(generating, tiny_tokenizer, HFEngineConfig()) if engine_name == "hf" else
             RolloutEngine(generating, tiny_tokenizer, RolloutEngineConfig(prefix_cache=True)))
    engine = ResumableEngine(inner, tiny_tokenizer)
    RefitAt(engine, generating, new, at=3)
    prompts = [tiny_tokenizer.encode(text) for text in TEXTS]
    inner.generate(prompts, PARAMS)  # under the old weights: a cache the rollout engine keeps, of these prompts

    outputs = engine.generate(prompts, PARAMS)
    for prompt, output in zip(prompts, outputs):
        assert len(output.token_ids) == 8 and output.finish_reason == "length"
        parked_at = output.versions.count(0)
        assert 0 < parked_at < 8 and output.versions == [0] * parked_at + [1] * (8 - parked_at)
        if engine_name == "hf":  # polled after each decode step: the third poll stops it after three tokens
            assert parked_at == 3
        under_old = reference_logprobs(old, prompt, output.token_ids)
        under_new = reference_logprobs(new, prompt, output.token_ids)
        got = torch.tensor(output.logprobs, dtype=torch.float64)
        torch.testing.assert_close(got[:parked_at], under_old[:parked_at], rtol=0, atol=1e-4)
        torch.testing.assert_close(got[parked_at:], under_new[parked_at:], rtol=0, atol=1e-4)
        assert (under_old[parked_at:] - under_new[parked_at:]).abs().max() > 1e-2  # the versions differ plainly


def test_a_refit_wanted_before_the_first_token_resumes_every_response_whole_under_the_new_weights(
        tiny_tokenizer, tiny_model):
    """A refit wanted between two calls (dynamic sampling's refills) stops the next at its first poll, which on
    the rollout engine comes before its first decode step: no token of the old weights, every response
    resumed whole under the new ones."""
    new = updated(tiny_model)
    generating = copy.deepcopy(tiny_model)
    engine = ResumableEngine(RolloutEngine(generating, tiny_tokenizer, RolloutEngineConfig()), tiny_tokenizer)
    RefitAt(engine, generating, new, at=1)
    prompts = [tiny_tokenizer.encode(text) for text in TEXTS]
    outputs = engine.generate(prompts, PARAMS)
    for prompt, output in zip(prompts, outputs):
        assert output.versions == [1] * 8 and output.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(output.logprobs, dtype=torch.float64),
                                   reference_logprobs(new, prompt, output.token_ids), rtol=0, atol=1e-4)

def test_without_a_refit_it_is_the_inner_engine(tiny_tokenizer, tiny_model):
    prompts = [tiny_tokenizer.encode(text) for text in TEXTS]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, return_logprobs=True, seed=3)
    expected = HFGenerationEngine(tiny_model, tiny_tokenizer, HFEngineConfig()).generate(prompts, params)
    engine = ResumableEngine(HFGenerationEngine(tiny_model, tiny_tokenizer, HFEngineConfig()), tiny_tokenizer)
    engine.weights_version = 4
    outputs = engine.generate(prompts, params)
    assert [(o.token_ids, o.logprobs, o.finish_reason) for o in outputs] == [
        (e.token_ids, e.logprobs, e.finish_reason) for e in expected]
    assert [o.versions for o in outputs] == [[4] * len(e.token_ids) for e in expected]


class Scripted(GenerationEngine):
    """Answers each call with the next scripted outputs and records what it was asked."""

    def __init__(self, *calls: list[GenerationOutput]):
        self.calls, self.asked = list(calls), []

    def generate(self, prompts, params, should_stop=None):
        self.asked.append((prompts, params))
        return self.calls.pop(0)


CHARACTERS = SimpleNamespace(decode=lambda ids, skip_special_tokens: "".join(map(chr, ids)))  # a token per character


def out(tokens, reason):
    return GenerationOutput(token_ids=tokens, finish_reason=reason, logprobs=[-float(t) for t in tokens])


def chars(text):
    return [ord(char) for char in text]


def resumed_once(inner):
    """A ResumableEngine over `inner`, whose one refit moves it to version 2."""
    engine = ResumableEngine(inner, CHARACTERS)
    engine.await_refit = lambda: setattr(engine, "weights_version", 2)
    return engine


def test_the_resumption_continues_each_parked_response_to_its_own_cap():
    inner = Scripted(
        # stopped by the refit: 0 ended (EOS), 1 and 2 parked after 2 and 4 tokens, 3 never started
        [out([5, 2], "eos"), out([7, 7], "length"), out([8, 8, 8, 8], "length"), out([], "length")],
        # resumed for the most any has left (6): 1 runs past its cap (cut there), 2 ends by EOS at its cap's
        # last token, 3 stops on a stop id
        [out([9, 9, 9, 9, 9], "length"), out([4, 2], "eos"), out([3, 6], "stop")])
    params = SamplingParams(max_new_tokens=6, return_logprobs=True, seed=11)
    outputs = resumed_once(inner).generate([[1], [1, 2], [3], [4]], params)

    assert len(inner.asked) == 2
    prompts, resumed = inner.asked[1]
    assert prompts == [[1, 2, 7, 7], [3, 8, 8, 8, 8], [4]]  # prompt + response so far, the finished one left out
    assert resumed.max_new_tokens == 6 and resumed.seed == request_seed(11, 1)
    assert [(o.token_ids, o.finish_reason) for o in outputs] == [
        ([5, 2], "eos"), ([7, 7, 9, 9, 9, 9], "length"), ([8, 8, 8, 8, 4, 2], "eos"), ([3, 6], "stop")]
    assert [o.versions for o in outputs] == [[0, 0], [0, 0, 2, 2, 2, 2], [0, 0, 0, 0, 2, 2], [2, 2]]
    assert outputs[1].logprobs == [-7.0, -7.0, -9.0, -9.0, -9.0, -9.0]


def test_a_stop_string_straddling_the_park_ends_the_response_where_it_completes():
    inner = Scripted(
        [out(chars("x</"), "length"), out(chars("ab"), "length"), out(chars("<"), "length")],
        # the engine sees the tokens after the park only: it misses the first row's "</a>", finds the
        # second's, and the third has none
        [out(chars("a>yz"), "length"), out(chars("</a>"), "stop"), out(chars("/b>a</a"), "length")])
    params = SamplingParams(max_new_tokens=8, stop=["</a>"], return_logprobs=True)
    outputs = resumed_once(inner).generate([[1], [1], [1]], params)
    assert [("".join(map(chr, o.token_ids)), o.finish_reason) for o in outputs] == [
        ("x</a>", "stop"), ("ab</a>", "stop"), ("</b>a</a", "length")]
    assert outputs[0].versions == [0, 0, 0, 2, 2] and outputs[0].logprobs == [-float(t) for t in chars("x</a>")]

