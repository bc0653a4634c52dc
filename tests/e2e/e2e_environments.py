"""An environment for the small end-to-end agent runs, loaded by dotted path `e2e_environments.Retry`.

No tools (the embedded model's chat template has none): the model answers the row's question; a wrong
answer gets one more try with feedback, so an episode has one or two model turns and its row holds an
observation between them. The environment gives no score: the reward registry scores the last turn.
"""

import re

from aligner_ext.agents.environment import Environment, Episode, StepResult


class Retry(Environment):
    def reset(self, row):
        return Episode(list(row.messages), state={"answer": str(row.ground_truth)})

    def step(self, assistant_message, state):
        found = re.findall(r"\\boxed\{([^}]*)\}", assistant_message["content"])
        if found and found[-1].strip() == state["answer"]:
            return StepResult(done=True)
        return StepResult([{"role": "user", "content": "wrong, try again"}], metrics={"retries": 1})
