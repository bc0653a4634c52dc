"""The `agents` config section: which environment answers a row, and the limits of an episode.

Free of torch, as the other settings modules are; read by the agent-episodes experience maker
(experience/agent_episodes.py) and its episode loop (episodes.py), which ends an episode at each limit
and counts it."""

from __future__ import annotations

from dataclasses import dataclass, field

from aligner_ext.rules import choice, number, plugin

TRUNCATION_SIDES = ("right", "left", "middle")


@dataclass
class EpisodeLimits:
    """When an episode ends, and how much of a tool's output the model reads."""

    max_turns: int = number(8, ge=1)  # model turns per episode; after the last one the episode ends (finish reason max_turns)
    max_total_tokens: int = number(4096, ge=1)  # ids of a training row (prompt, sampled, template, observation); a turn samples at most what is left, and an observation that does not fit ends the episode
    max_observation_tokens: int = number(512, ge=1)  # tokens of one new message's content (a tool result, feedback); longer content is cut and the cut tokens counted
    observation_truncation: str = choice("right", *TRUNCATION_SIDES)  # which part of a too-long content is cut: right (keep the start) | left (keep the end) | middle (keep both ends)
    max_episode_seconds: float = number(600.0, gt=0)  # wall-clock limit from reset to the last step; keep it under any sandbox's lifetime


@dataclass
class AgentsConfig:
    """Agent episodes (algorithm.experience_maker=agent_episodes, docs/agents.md)."""

    environment: str = plugin("auto", "aligner_ext.agents.environment:ENVIRONMENTS", "auto")  # the environment of every row; auto: the one registered for each row's data_source
    agent: str | None = None  # agent code as the rollout: `pkg.module:agent`, an `async def agent(client, row)` whose openai client talks to the trainer's session endpoint (docs/agents.md); unset: environment episodes
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)  # when an episode ends
    max_concurrent_episodes: int = number(256, ge=1)  # episodes in flight at once; each holds an engine slot (with the rollout engine, its KV cache) while its environment answers

    def __post_init__(self) -> None:
        if self.agent and self.environment != "auto":
            raise ValueError(f"agents.agent={self.agent} and agents.environment={self.environment} both say how "
                             "episodes run: set one of them")
