"""Turn sessions: how an episode's model turns reach the generation engine.

The episode loop (episodes.py) hands each model turn to a session as the episode's whole trajectory
so far (`submit(key, ids, max_new_tokens, seed)`) and collects finished turns from `step()`. An engine
with turn sessions of its own (`GenerationEngine.open_session`: the rollout engine's, which keeps each
episode's KV cache between its turns, so a turn prefills only its new ids) returns one; for every other
engine (the HF reference engine, remote servers, colocated vLLM) `GenerateEachTurn` runs each waiting
turn as a generate call of its own, prefilling the whole trajectory every turn.

Both give a turn the tokens `engine.generate([ids], params with max_new_tokens and seed)[0]` gives: a
turn's sampling stream depends on its seed alone, never on which turns share a batch or in which order
episodes submit, so episodes are reproducible whatever order their tools finish in. With
`params.return_routing`, an engine that records a mixture of experts' routing (the rollout engine)
returns it with each turn for the whole trajectory, in either session.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, deque
from typing import Any, Hashable

from aligner_ext.generation.base import GenerationEngine, GenerationOutput, SamplingParams


class GenerateEachTurn:
    """A session over any engine: each step runs the oldest waiting turn as one `generate` call."""

    def __init__(self, engine: GenerationEngine, params: SamplingParams):
        self.engine, self.params = engine, params
        self.waiting: deque[tuple[Hashable, list[int], int, int]] = deque()
        self.stats: Counter[str] = Counter()

    def submit(self, key: Hashable, ids: list[int], max_new_tokens: int, seed: int) -> None:
        self.waiting.append((key, list(ids), max_new_tokens, seed))

    def busy(self) -> bool:
        return bool(self.waiting)

    def step(self) -> list[tuple[Hashable, GenerationOutput]]:
        key, ids, max_new_tokens, seed = self.waiting.popleft()
        params = dataclasses.replace(self.params, max_new_tokens=max_new_tokens, seed=seed)
        output = self.engine.generate([ids], params)[0]
        self.stats["turns"] += 1
        self.stats["prefilled_tokens"] += len(ids)
        return [(key, output)]

    def release(self, key: Hashable) -> None:  # noqa: B027 - nothing is kept between turns
        """Nothing is kept between an episode's turns."""

    def close(self) -> None:  # noqa: B027
        """Nothing to free."""


def open_turns(engine: GenerationEngine, params: SamplingParams, max_length: int, max_episodes: int) -> Any:
    """The engine's own turn session when it has one, else `GenerateEachTurn`."""
    open_session = getattr(engine, "open_session", None)
    session = open_session(params, max_length, max_episodes) if open_session is not None else None
    return session if session is not None else GenerateEachTurn(engine, params)
