"""`python`: the sandboxed Python tool (sandbox.py) and the environment that offers it.

The environment `python` serves the `python_digits` task (data/tasks): questions a model answers by
running a short program rather than by reasoning digit by digit. Its score is `math_verify`
(rewards/math_answer.py) over the final answer, as the calculator's: 1.0 when the last `\\boxed{}` of
the episode's last turn equals the ground truth.

Before its first episode the environment runs an empty program (`check_sandbox`): a machine where the
sandbox cannot contain code (not root, no namespaces) stops the run with the sandbox's one line
(a UserError, which the episode loop never turns into a failed episode), never runs code uncontained.
"""

from __future__ import annotations

from aligner_ext.agents.environment import Episode, register_environment
from aligner_ext.agents.sandbox import SandboxLimits, check_sandbox, python_tool
from aligner_ext.agents.tool_environment import ToolEnvironment, ToolEpisode
from aligner_ext.data.types import PromptRow
from aligner_ext.rewards.base import RewardResult
from aligner_ext.rewards.math_answer import math_verify_reward

LIMITS = SandboxLimits()  # sandbox.py's defaults: 10 s, 512 MiB, 8 KiB of output per stream


@register_environment("python", data_sources=("python_digits",))
class PythonEnvironment(ToolEnvironment):
    """Questions answered by running code in the sandbox; the final answer is checked against the ground truth."""

    TOOLS = (python_tool(LIMITS),)

    def __init__(self, **runner_options):
        super().__init__(**{"timeout_s": LIMITS.wall_seconds + 5, **runner_options})  # the sandbox reports its own time-out
        self.sandbox_checked = False

    async def reset(self, row: PromptRow) -> Episode:
        if not self.sandbox_checked:
            await check_sandbox(LIMITS)
            self.sandbox_checked = True
        return await super().reset(row)

    def score(self, state: ToolEpisode) -> RewardResult:
        """The reward with whether it was correct, so held-out accuracy is defined."""
        return math_verify_reward(state.answer or "", state.row)
