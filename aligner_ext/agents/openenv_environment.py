"""`OpenEnvEnvironment`: an OpenEnv environment server (PyPI `openenv-core`, tested with 0.3.0), reached
through OpenEnv's own client, as one of our environments.

The server runs where its author put it (started by the user, in a container, on 127.0.0.1); a subclass
names it and the action field that carries the model's text:

    class Echo(OpenEnvEnvironment):
        BASE_URL = "http://127.0.0.1:8000"
        ACTION_FIELD = "message"
        OBSERVATION_FIELD = "echoed_message"

and a run picks it with `agents.environment=my_module:Echo`. One episode is one server session:

- `reset(row)`: a `GenericEnvClient` (openenv-core's client of plain dicts, so no environment-specific
  package is installed here) opens its websocket (one server session per connection) and resets it.
  The first messages are the row's prompt, then the reset observation's text as a user message when
  it has any.
- `step(message)`: the turn's text becomes the action `{ACTION_FIELD: content}`; the observation's
  text comes back as a user message; `done` is the server's.
- `score(state)`: the sum of the server's rewards over the episode (a reward of None counts 0), so the
  environment owns the episode's reward; the connection is closed.

Decisions: our rows drive the data (their prompt opens the conversation, their `data_source` names the
run's task), the server drives the game. Text actions only: a server whose actions are MCP tool calls
is not bridged yet. A server that raises, dies or does not answer within `MESSAGE_TIMEOUT_S` ends its
episode as an environment error (episodes.py: one logged line, counted, reward 0), never the run; a
client time-out is raised as an error of its own rather than as a TimeoutError, which the episode loop
would count as the episode's wall-clock limit.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aligner_ext.agents.environment import Environment, Episode, Message, StepResult
from aligner_ext.data.types import PromptRow
from aligner_ext.errors import UserError
from aligner_ext.rewards.base import RewardResult

INSTALL = "pip install 'aligner_ext[openenv]'"


def require_openenv() -> Any:
    """openenv-core's `GenericEnvClient`, or one line saying how to install it."""
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ImportError as err:
        raise UserError(f"an OpenEnv environment needs the package openenv-core ({err}); install it with: "
                        f"{INSTALL}") from err
    return GenericEnvClient


@dataclass
class OpenEnvEpisode:
    """One episode: its server session (the client's connection) and the rewards the server gave."""

    client: Any
    rewards: list[float] = field(default_factory=list)


class OpenEnvEnvironment(Environment):
    """An OpenEnv server's sessions as episodes (module docstring). Subclasses set `BASE_URL` and the
    fields; `action` and `observation_text` are the override points for richer actions or observations."""

    BASE_URL = ""  # the server, e.g. "http://127.0.0.1:8000" (the client speaks websocket at <BASE_URL>/ws)
    ACTION_FIELD = "message"  # the action's field that holds the model's text
    OBSERVATION_FIELD: str | None = None  # the observation's field shown to the model; None: the observation as JSON
    CONNECT_TIMEOUT_S = 10.0
    MESSAGE_TIMEOUT_S = 60.0  # a reset or step the server has not answered by then ends the episode

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        require_openenv()  # when the run's environment is imported, before any model loads

    def __init__(self) -> None:
        if not self.BASE_URL:
            raise UserError(f"{type(self).__name__} names no OpenEnv server: set its BASE_URL, e.g. "
                            "BASE_URL = \"http://127.0.0.1:8000\"")
        self.client_class = require_openenv()

    async def reset(self, row: PromptRow) -> Episode:
        client = self.client_class(base_url=self.BASE_URL, connect_timeout_s=self.CONNECT_TIMEOUT_S,
                                   message_timeout_s=self.MESSAGE_TIMEOUT_S)
        result = await self._answer(client, "reset", client.reset())
        messages = [dict(message) for message in row.messages]
        text = self.observation_text(result.observation)
        if text:
            messages.append({"role": "user", "content": text})
        return Episode(messages, state=OpenEnvEpisode(client))

    async def step(self, assistant_message: Message, state: OpenEnvEpisode) -> StepResult:
        result = await self._answer(state.client, "step", state.client.step(self.action(assistant_message)))
        state.rewards.append(float(result.reward or 0.0))
        if result.done:
            return StepResult(done=True)
        return StepResult([{"role": "user", "content": self.observation_text(result.observation)}])

    async def score(self, state: OpenEnvEpisode) -> RewardResult:
        await state.client.close()
        return RewardResult(sum(state.rewards), info={"openenv_steps": len(state.rewards)})

    def action(self, assistant_message: Message) -> dict[str, Any]:
        """The action a model turn becomes: its text in `ACTION_FIELD`."""
        return {self.ACTION_FIELD: assistant_message.get("content") or ""}

    def observation_text(self, observation: dict[str, Any]) -> str:
        """What the model reads of an observation: `OBSERVATION_FIELD`, or the whole observation as JSON."""
        if self.OBSERVATION_FIELD is None:
            return json.dumps(observation, sort_keys=True) if observation else ""
        return str(observation.get(self.OBSERVATION_FIELD) or "")

    async def _answer(self, client: Any, request: str, answer: Any) -> Any:
        """The server's answer; a client time-out as an error naming the server (module docstring)."""
        try:
            return await answer
        except asyncio.TimeoutError as err:
            await client.close()
            raise RuntimeError(f"the OpenEnv server at {self.BASE_URL} did not answer {request} within "
                               f"{self.MESSAGE_TIMEOUT_S:g} s") from err
