"""What an environment is, and the table that finds one for a row.

An episode of an agent rollout talks to an environment in OpenAI chat messages:

    episode = await env.reset(row)                 # first messages, tool schemas, the episode's state
    step = await env.step(assistant_message, episode.state)   # after every model turn
    ... until step.done; then reward = await env.score(episode.state)

`reset`, `step` and `score` are coroutines so that one process holds many waiting episodes (a tool
call, an HTTP environment server). A subclass may define them as plain functions instead: the class
wraps each one so that it runs in a worker thread and is awaited like the rest, and a slow call
delays only its own episode. A plain method must then be safe to call from several threads at once;
everything an episode changes belongs in its `state`, not on the environment object.

The shape fits the environments of other frameworks (docs/agents.md, "Bringing environments"): a
verifiers rollout, whose model requests are our turns (verifiers_environment.py), and an OpenEnv
server's session (`reset()` / `step(action)` returning observation, reward and done;
openenv_environment.py).

Two tables, as for rewards (rewards/base.py):
- `ENVIRONMENTS`: environment name -> class; a name that is not registered but contains a dot is
  imported as `pkg.module:Class`, so user environments plug in without registering.
- `ENVIRONMENT_SOURCES`: data_source -> environment name, filled by
  `register_environment(..., data_sources=...)`, so each row can pick its own environment.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from aligner_ext.registry import Registry
from aligner_ext.rewards.base import RewardResult

ENVIRONMENTS = Registry("environment")
ENVIRONMENT_SOURCES: dict[str, str] = {}

Message = dict[str, Any]  # an OpenAI chat message: {"role": ..., "content": ..., "tool_calls": [...]}


@dataclass
class Episode:
    """What `reset` gives: the conversation's first messages, the tools the model may call, and the
    state the environment keeps for this episode (passed back to every `step`)."""

    messages: list[Message]  # the prompt, e.g. [{"role": "system", ...}, {"role": "user", ...}]
    tools: list[dict[str, Any]] = field(default_factory=list)  # JSON schemas as chat templates take them (tools.py)
    state: Any = None


@dataclass
class StepResult:
    """What `step` gives after a model turn."""

    messages: list[Message] = field(default_factory=list)  # tool results (role "tool") or feedback (role "user")
    reward: float | None = None  # a per-turn reward, or None; the episode's reward adds them to its final one
    done: bool = False  # the episode ends here: the model does not answer `messages`
    metrics: dict[str, float] = field(default_factory=dict)  # counts of this step (e.g. tool errors by reason): summed over the episode, reported per episode as agent/<name>


class Environment:
    """Base class of environments. Subclasses override `reset` and `step`, and `score` when the
    environment owns the final reward; each may be `async def` or a plain `def` (module docstring)."""

    WRAPPED = ("reset", "step", "score")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in cls.WRAPPED:
            method = cls.__dict__.get(name)
            if method is not None and not inspect.iscoroutinefunction(method):
                setattr(cls, name, _in_thread(method))

    async def reset(self, row: Any) -> Episode:
        """Start an episode for a dataset row (a PromptRow, or whatever the environment reads)."""
        raise NotImplementedError(f"{type(self).__name__} must define reset(row)")

    async def step(self, assistant_message: Message, state: Any) -> StepResult:
        """Answer one model turn: `assistant_message` holds its text (`content`) and parsed `tool_calls`."""
        raise NotImplementedError(f"{type(self).__name__} must define step(assistant_message, state)")

    async def score(self, state: Any) -> float | RewardResult | None:
        """The episode's final reward (a RewardResult when the environment also says whether it was
        correct); None leaves it to the reward registry, which scores the last model turn's text."""
        return None


def _in_thread(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` as a coroutine function that runs it in a worker thread."""

    @functools.wraps(method)
    async def run(self, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.to_thread(method, self, *args, **kwargs)

    return run


def register_environment(name: str, *aliases: str, data_sources: tuple[str, ...] = ()) -> Callable[[type], type]:
    """Register an Environment subclass under `name` (and aliases) and make it the environment of the
    rows of `data_sources`."""

    def decorator(cls: type) -> type:
        _check_is_environment(cls, name)
        ENVIRONMENTS.register(name, *aliases)(cls)
        for source in data_sources:
            if ENVIRONMENT_SOURCES.get(source, name) != name:
                raise ValueError(f"data_source {source!r} is mapped to both environments "
                                 f"{ENVIRONMENT_SOURCES[source]!r} and {name!r}")
            ENVIRONMENT_SOURCES[source] = name
        return cls

    return decorator


def environment_class(name: str | None = None, data_source: str | None = None) -> type:
    """The Environment subclass named `name`, else the one registered for `data_source`."""
    if name is None:
        if data_source not in ENVIRONMENT_SOURCES:
            known = ", ".join(sorted(ENVIRONMENT_SOURCES)) or "(none)"
            raise KeyError(f"no environment is named and none is registered for data_source {data_source!r}; "
                           f"data sources with an environment: {known}")
        name = ENVIRONMENT_SOURCES[data_source]
    cls = ENVIRONMENTS.get(name)
    _check_is_environment(cls, name)
    return cls


def _check_is_environment(cls: Any, name: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise TypeError(f"environment {name!r} is {cls!r}; it must be a subclass of "
                        "aligner_ext.agents.environment.Environment")
