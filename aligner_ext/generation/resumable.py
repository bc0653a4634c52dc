"""Partial rollouts: a `generate` call whose unfinished responses are parked at a refit of the engine's
weights and resumed under the new ones (generation ahead of training, experience/ahead.py; docs/async.md).

`ResumableEngine` wraps the generation thread's engine (hf or rollout, both stop between two decode steps
when their `should_stop` turns true; remote, whose servers abort their requests then), so every call of the
experience maker parks: group sampling's (dynamic sampling's refills each a call), the graded system
prompt's (each response resumes from its own generator prompt) and both of MTPO's rounds. A call runs the
inner engine with `should_stop = refit_wanted`; when it stops with responses unfinished, it parks them and
calls `await_refit` (the thread lets the trainer refit the copy, or push to the servers, and returns once
it has), then resumes every parked response as a request of
its own: the prompt followed by the response so far, prefilled whole under the new weights, for the
tokens it has left. So:
- a token keeps the log-prob and the version of the weights that sampled it: tokens sampled before the
  refit carry the old version, those after it the new one (`GenerationOutput.versions`, set on every
  output of a call, so a response finished before the refit keeps the old version too);
- no key or value computed under the old weights serves a resumed token: the re-prefill computes them
  again under the new weights (a stopped rollout-engine call keeps no KV cache, and a kept one is
  dropped once a parameter changed in place, `weights_fingerprint`);
- a resumed request draws from a stream of its own, `request_seed(seed, resumption)`, never the
  parked call's again.
A resumption asks for as many tokens as the response with the most left needs; each response is cut
at its own cap ("length"). The inner engine matches stop strings within one call's tokens; one that
straddles a park (it starts before it and ends after; MTPO's round stops are its calls' `stop` too) is
matched here, on the tokens after the park whose text, with the newest token's, could still reach back
past it (`cut_at_straddling_stop`). Routing records are not joined across a park (routing replay is
refused with generation ahead).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from aligner_ext.generation.base import EngineWrapper, GenerationEngine, GenerationOutput, SamplingParams
from aligner_ext.generation.sampler import request_seed
from aligner_ext.generation.stopping import StopStringMatcher


@dataclass
class Partial:
    """One response as far as it got: its tokens, their log-probs and versions, and how it finished."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # None while it goes on

    def output(self, return_logprobs: bool) -> GenerationOutput:
        return GenerationOutput(token_ids=self.token_ids, finish_reason=self.finish_reason,
                                logprobs=self.logprobs if return_logprobs else None, versions=self.versions)


class ResumableEngine(EngineWrapper):
    """`inner`, whose calls park at a refit and resume under the new weights (module docstring).

    Whoever refits the weights sets `refit_wanted` (polled between decode steps) and `await_refit`
    (called with responses parked; returns once `weights_version` is the new weights')."""

    def __init__(self, inner: GenerationEngine, tokenizer):
        super().__init__(inner)
        self.tokenizer = tokenizer  # decodes responses for the stop strings that straddle a park
        self.refit_wanted: Callable[[], bool] = lambda: False
        self.await_refit: Callable[[], None] = lambda: None

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        responses = [Partial() for _ in prompts]
        matcher = StopStringMatcher(params.stop, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True))
        going = list(range(len(prompts)))
        resumption = 0
        while going:
            if resumption:
                self.await_refit()
            most_left = max(params.max_new_tokens - len(responses[index].token_ids) for index in going)
            seed = params.seed if params.seed is None or not resumption else request_seed(params.seed, resumption)
            version = self.weights_version  # a refit waits for this call to stop or end
            outputs = self.inner.generate([prompts[index] + responses[index].token_ids for index in going],
                                          replace(params, max_new_tokens=most_left, seed=seed),
                                          should_stop=self.refit_wanted)
            continue_with([responses[index] for index in going], outputs, params.max_new_tokens, version, matcher)
            going = [index for index in going if responses[index].finish_reason is None]
            resumption += 1
        return [response.output(params.return_logprobs) for response in responses]


def continue_with(responses: list[Partial], outputs: list[GenerationOutput], max_new_tokens: int, version: int,
                  matcher: StopStringMatcher) -> None:
    """Append one engine call's `outputs` (sampled at `version`) to the `responses` they continue (`extend`),
    matching the stop strings that straddle where each was resumed (`cut_at_straddling_stop`)."""
    for response, output in zip(responses, outputs):
        resumed_at = len(response.token_ids)
        extend(response, output, max_new_tokens, version)
        if matcher and resumed_at:
            cut_at_straddling_stop(response, matcher, resumed_at)


def extend(response: Partial, output: GenerationOutput, max_new_tokens: int, version: int) -> None:
    """Append one inner call's `output` (sampled at `version`) to `response`, cut at `max_new_tokens`
    in all; it finishes at an end the engine reported or at the cap, and is parked otherwise (its
    call stopped early)."""
    left = max_new_tokens - len(response.token_ids)
    tokens = output.token_ids[:left]
    response.token_ids += tokens
    response.logprobs += (output.logprobs or [])[:left]
    response.versions += [version] * len(tokens)
    if len(output.token_ids) <= left and output.finish_reason != "length":
        response.finish_reason = output.finish_reason
    elif len(response.token_ids) == max_new_tokens:
        response.finish_reason = "length"


def cut_at_straddling_stop(response: Partial, matcher: StopStringMatcher, parked_at: int) -> None:
    """End `response` ("stop") at the first token after the park (`parked_at` tokens) that completes a stop
    string starting before the park: one the engine, seeing the tokens after the park only, missed."""
    tokens = response.token_ids
    for end in range(parked_at + 1, len(tokens) + 1):
        # a stop string ending in token end - 1 and starting before the park holds the whole text of the
        # tokens between them, plus a character on each side: once that text has max_chars - 1
        # characters, none can
        if len(matcher.decode(tokens[parked_at : end - 1])) >= matcher.max_chars - 1:
            return
        if matcher.completed_by_last_token(tokens[:end]):
            if end < len(tokens) or response.finish_reason in (None, "length"):  # an engine's EOS comes first
                del response.token_ids[end:], response.logprobs[end:], response.versions[end:]
                response.finish_reason = "stop"
            return

