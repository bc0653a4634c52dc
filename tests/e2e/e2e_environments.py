"""Environments for the small end-to-end agent runs, loaded by dotted path `e2e_environments.Retry`.

No tools (the embedded model's chat template has none): the model answers the row's question; a wrong
answer gets one more try with feedback, so an episode has one or two model turns and its row holds an
observation between them. The environment gives no score: the reward registry scores the last turn.
`Recorded` also writes every model turn it reads, with its row, to a file of the process that played it.
"""

import json
import os
import re
from pathlib import Path

from aligner_ext.agents.environment import Environment, Episode, StepResult


class Retry(Environment):
    def reset(self, row):
        return Episode(list(row.messages), state={"answer": str(row.ground_truth)})

    def step(self, assistant_message, state):
        found = re.findall(r"\\boxed\{([^}]*)\}", assistant_message["content"])
        if found and found[-1].strip() == state["answer"]:
            return StepResult(done=True)
        return StepResult([{"role": "user", "content": "wrong, try again"}], metrics={"retries": 1})


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
