"""Limits of an agent episode, as data.

The dataclass of the future `agents.limits` config section, each field with its rule, free of torch as
the other settings modules are. It is not in conf/ or the run configuration yet, and nothing enforces
it yet: the episode loop that ends an episode at each limit (and counts it) is the next step
(docs/agents.md)."""

from __future__ import annotations

from dataclasses import dataclass

from aligner_ext.rules import choice, number

TRUNCATION_SIDES = ("right", "left", "middle")


@dataclass
class EpisodeLimits:
    """When an episode ends, and how much of a tool's output the model reads."""

    max_turns: int = number(8, ge=1)  # model turns per episode; after the last one the episode ends (finish reason max_turns)
    max_total_tokens: int = number(4096, ge=1)  # ids of a training row (prompt, sampled, template, observation); a turn samples at most what is left, and an observation that does not fit ends the episode
    max_observation_tokens: int = number(512, ge=1)  # tokens of one new message's content (a tool result, feedback); longer content is cut and the cut tokens counted
    observation_truncation: str = choice("right", *TRUNCATION_SIDES)  # which part of a too-long content is cut: right (keep the start) | left (keep the end) | middle (keep both ends)
    max_episode_seconds: float = number(600.0, gt=0)  # wall-clock limit from reset to the last step; keep it under any sandbox's lifetime
