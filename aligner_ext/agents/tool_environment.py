"""`ToolEnvironment`: the common case of an environment, typed Python functions as the model's tools.

A subclass lists its tools and, when it owns the final reward, defines `score`:

    class Calculator(ToolEnvironment):
        TOOLS = (calculator,)

- `reset(row)`: the row's prompt messages (copied: the n episodes of a GRPO group share the row), the
  tools' schemas and a fresh `ToolEpisode` as the state.
- `step(message, state)`: the turn's call attempts run through one `ToolRunner` (tools.py), which
  answers each with a `tool` message, an error observation for an unknown tool, bad arguments, an
  exception or a time-out. The attempts are the message's well-formed `tool_calls`, in order, then its
  `malformed_tool_calls` (the `{"text", "problem"}`, with Mistral's `"id"`, that the episode loop
  attaches when the turn had any),
  each answered with its problem: the assistant message has lost their order among the good calls,
  and the template renders a turn's text, malformed attempts included, before its calls.
- A turn without any call attempt is the final answer: the episode ends (done, no new messages).
- `score(state)`: None by default, so the reward registry scores the final answer (`state.answer`).

Counting: each step reports its tools' counts in `StepResult.metrics`, which the episode loop sums
per episode and reports per episode as `agent/<key>` (the loop counts turns and call attempts itself).
Keys (`STEP_COUNTS`): `tool_errors` (the step's failed attempts, malformed ones included), one
`tool_errors_<reason>` per reason of `tools.ERRORS` that occurred (`unknown_tool`, `bad_arguments`,
`exception`, `timeout`, `malformed`) and `tool_seconds` (the summed wall time of the calls that ran;
calls of one turn run concurrently, so the turn may have taken less). A key never counted is absent.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from aligner_ext.agents.environment import Environment, Episode, Message, StepResult
from aligner_ext.agents.tool_calls import MalformedCall, ParsedTurn, ToolCall
from aligner_ext.agents.tools import ERRORS, ToolRunner, tool_message
from aligner_ext.data.types import PromptRow

STEP_COUNTS = ("tool_errors", *(f"tool_errors_{reason}" for reason in ERRORS), "tool_seconds")  # StepResult.metrics keys


@dataclass
class ToolEpisode:
    """The state of one episode of a ToolEnvironment."""

    row: PromptRow
    answer: str | None = None  # the content of the latest assistant turn: the final answer once the episode is done


class ToolEnvironment(Environment):
    """An environment whose only answers are its tools' results (module docstring).

    Subclasses set `TOOLS`, each a function with a type hint on every argument and a docstring with an
    `Args:` section (tools.py); `runner_options` go to the `ToolRunner` (e.g. `timeout_s`)."""

    TOOLS: tuple[Callable[..., Any], ...] = ()

    def __init__(self, **runner_options: Any):
        if not self.TOOLS:
            raise TypeError(f"{type(self).__name__} lists no TOOLS; a ToolEnvironment needs at least one tool")
        self.runner = ToolRunner(list(self.TOOLS), **runner_options)

    async def reset(self, row: PromptRow) -> Episode:
        return Episode([dict(message) for message in row.messages], self.runner.schemas, ToolEpisode(row))

    async def step(self, assistant_message: Message, state: ToolEpisode) -> StepResult:
        turn = call_attempts(assistant_message)
        state.answer = turn.content
        if not turn.calls:
            return StepResult(done=True)
        results = await self.runner.run(turn)
        counts: Counter[str] = Counter()
        for result in results:
            if result.error:
                counts["tool_errors"] += 1
                counts[f"tool_errors_{result.error}"] += 1
            if result.seconds:
                counts["tool_seconds"] += result.seconds
        return StepResult([tool_message(call, result) for call, result in zip(turn.calls, results)], metrics=dict(counts))


def call_attempts(message: Message) -> ParsedTurn:
    """The turn an assistant message holds: its content, its `tool_calls`, then its `malformed_tool_calls`."""
    calls: list[ToolCall | MalformedCall] = [ToolCall(call["function"]["name"], call["function"]["arguments"],
                                                      call.get("id", "")) for call in message.get("tool_calls") or ()]
    calls += [MalformedCall(attempt["text"], attempt["problem"], attempt.get("id", ""))
              for attempt in message.get("malformed_tool_calls") or ()]
    return ParsedTurn(message.get("content") or "", calls)
