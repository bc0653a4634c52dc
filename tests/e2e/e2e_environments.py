"""Environments for the small end-to-end agent runs, loaded by dotted path (`e2e_environments.Retry`).

`Retry`: no tools; the model answers the row's question; a wrong answer gets one more try with
feedback, so an episode has one or two model turns and its row holds an observation between them. The
environment gives no score: the reward registry scores the last turn.

`CheckedRetry`: `Retry` with a tool. The embedded model at the tests' size writes no well-formed call
of its own, so the environment makes one for it: each wrong answer goes to the `check` tool, through a
`ToolRunner` (a worker thread, its time limit and counts), and the episode reads the tool's result as a
`tool` message before the feedback. The tool is offered in the prompt (the template's `Tools:` line),
so the episode also reads any call the model does write.

`Recorded`: `Retry` that also writes every model turn it reads, with its row, to a file of the process
that played it (tests/megatron/test_megatron_agent_episodes.py compares the ranks' episodes).
"""

import json
import os
import re
from pathlib import Path

from aligner_ext.agents.environment import Environment, Episode, StepResult
from aligner_ext.agents.tool_calls import ParsedTurn, ToolCall
from aligner_ext.agents.tools import ToolRunner, tool_message


class Retry(Environment):
    def reset(self, row):
        return Episode(list(row.messages), state={"answer": str(row.ground_truth)})

    def step(self, assistant_message, state):
        found = re.findall(r"\\boxed\{([^}]*)\}", assistant_message["content"])
        if found and found[-1].strip() == state["answer"]:
            return StepResult(done=True)
        return StepResult([{"role": "user", "content": "wrong, try again"}], metrics={"retries": 1})


def check(answer: str) -> str:
    """Say how many characters of an answer are digits.

    Args:
        answer: The answer to check.
    """
    return f"{sum(character.isdigit() for character in answer)} of {len(answer)} characters are digits"


class CheckedRetry(Retry):
    def __init__(self):
        self.runner = ToolRunner([check], timeout_s=30)

    async def reset(self, row):
        episode = await super().reset(row)
        episode.tools = self.runner.schemas
        return episode

    async def step(self, assistant_message, state):
        result = await super().step(assistant_message, state)
        if result.done:
            return result
        call = ToolCall("check", {"answer": assistant_message["content"]})
        [checked] = await self.runner.run(ParsedTurn(assistant_message["content"], [call]))
        return StepResult([tool_message(call, checked), *result.messages], metrics={**result.metrics, "checks": 1})


class Recorded(Retry):
    """Retry that appends {"row", "turn"} for each model turn to `$E2E_EPISODE_LOG/rank<R>.jsonl` (R: the
    torchrun rank, 0 without torchrun)."""

    async def reset(self, row):
        episode = await super().reset(row)
        episode.state["row"] = row.row_id
        return episode

    async def step(self, assistant_message, state):
        path = Path(os.environ["E2E_EPISODE_LOG"]) / f"rank{os.environ.get('RANK', '0')}.jsonl"
        with path.open("a") as log:  # in the event loop's thread: one write at a time
            log.write(json.dumps({"row": state["row"], "turn": assistant_message["content"]}) + "\n")
        return await super().step(assistant_message, state)
