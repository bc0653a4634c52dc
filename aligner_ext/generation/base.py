"""The generation-engine interface: token ids in, token ids (and optional log-probs) out.

Every engine (HF here; Megatron-core, vLLM, remote servers later) implements `GenerationEngine`.
Nothing between stages re-tokenises text: the experience maker hands prompt ids in and stores the
returned ids as the response.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aligner_ext.generation.settings import MIN_TEMPERATURE
from aligner_ext.registry import Registry

if TYPE_CHECKING:
    import torch

ENGINES = Registry("generation engine")
NOT_RECORDED = -1  # an expert index where no routing was recorded (`GenerationOutput.routing`, ExperienceBatch's)


def check_sampling(prefix: str, length_key: str, length: int, temperature: float, top_p: float) -> None:
    """The sampling settings every engine serves, named `<prefix><key>` in the error (a config section
    or SamplingParams)."""
    if length < 1:
        raise ValueError(f"{prefix}{length_key} must be >= 1, got {length}")
    if temperature < 0 or 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(f"{prefix}temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got {temperature:g}")
    if not 0 < top_p <= 1:
        raise ValueError(f"{prefix}top_p must be in (0, 1], got {top_p}")


@dataclass
class SamplingParams:
    """How to sample one call's sequences."""

    max_new_tokens: int = 32  # response length cap, in tokens
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus sampling mass; 1.0 disables it
    top_k: int = 0  # sample among the k most likely tokens only; 0 disables it
    stop: list[str] = field(default_factory=list)  # stop strings, kept in the output
    stop_token_ids: list[int] = field(default_factory=list)  # ids that end a sequence ("stop"), kept in the output; unlike EOS, not affected by ignore_eos
    return_logprobs: bool = False  # return the sampling log-prob of every generated token
    seed: int | None = None  # seeds this call's sampling; None draws from the global torch RNG
    ignore_eos: bool = False  # an EOS id does not end a sequence (benchmarks: every response runs to max_new_tokens unless a stop string ends it)
    return_routing: bool = False  # a mixture of experts: return the experts its routers chose for every token (engines that record them; the trainer asks, models/moe.py)


@dataclass
class GenerationOutput:
    """One generated sequence."""

    token_ids: list[int]  # generated ids, EOS and the tokens completing a stop string included
    finish_reason: str  # "stop" (a stop string or stop token id), "eos" (end-of-sequence token), "length" (cap reached)
    # per generated token: its log-prob under the distribution it was drawn from (after temperature
    # and top-p); greedy decoding reports the temperature-1 log-softmax
    logprobs: list[float] | None = None
    # A mixture of experts asked with `return_routing`, on an engine that records it (the rollout
    # engine): [prompt + generated tokens, layers, k] int16, the experts each layer's router chose
    # for each token; NOT_RECORDED on the last generated token, which is sampled and never fed back.
    # None otherwise.
    routing: torch.Tensor | None = None
    # per generated token: the policy version of the weights that sampled it, where a call's weights may
    # change (partial rollouts, generation/resumable.py); None: all at the engine's `weights_version`
    versions: list[int] | None = None


class GenerationEngine(abc.ABC):
    """Produces continuations of token-id prompts.

    Implementations must: keep stop strings (and EOS) in the output and cut everything after them;
    report a per-sequence finish reason; accept prompts of different lengths in one call.
    """

    reports_finished: bool = False  # `generate` also takes per-prompt `caps` and calls `on_finished(i)` as outputs become whole (the rollout engine; groups carried over need it, experience/carry_over.py)
    weights_version: int = 0  # the policy version (optimizer updates applied) of the weights it samples with; set by whoever hands it weights, before `update_weights` (a push to servers carries it: generation/remote.py), by the loop's refit (trainer/loop.py) and generation ahead's (experience/ahead.py)

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[GenerationOutput]:
        """Continue every prompt once; output i belongs to prompt i."""

    def open_session(self, params: SamplingParams, max_length: int, max_episodes: int):
        """A turn session for multi-turn episodes: each episode's turns continue on the K/V its earlier
        turns left in the engine's cache, episodes batched together (generation/turns.py has the rollout
        engine's). None here: this engine has no turn sessions, and the caller generates each turn by
        `generate` on the episode's whole ids."""
        return None

    def release_memory(self) -> None:  # noqa: B027 - engines that free their caches per call do nothing
        """Free what the engine holds on the device before the policy trains (a colocated server sleeps);
        the next `update_weights` brings it back."""

    def update_weights(self, policy_model) -> None:  # noqa: B027 - engines sharing the model do nothing
        """Make the engine sample from the policy's current weights (called after each update)."""


class EngineWrapper(GenerationEngine):
    """An engine around `inner` that samples with its weights (parking its calls, splitting them across
    ranks): the weights, their version (which a push to servers carries) and the device memory are the
    inner engine's."""

    def __init__(self, inner: GenerationEngine):
        self.inner = inner

    @property
    def weights_version(self) -> int:
        return self.inner.weights_version

    @weights_version.setter
    def weights_version(self, version: int) -> None:
        self.inner.weights_version = version

    def release_memory(self) -> None:
        self.inner.release_memory()

    def update_weights(self, policy_model) -> None:
        self.inner.update_weights(policy_model)
