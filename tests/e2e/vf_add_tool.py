"""A multi-turn verifiers 0.4.0 environment with a tool, in the style of its tool examples: a task asks
for a sum, the tool `add` is a verifiers `Toolset` (an MCP server, served by verifiers' own `run`; the
test starts it on 127.0.0.1 and puts its address in E2E_VF_TOOLS_URL), the harness loops until a reply
without a tool call, and the reward is 1 when the last reply holds the sum."""

import os

import verifiers.v1 as vf

from aligner_ext.agents.verifiers_environment import VerifiersEnvironment


class AddTools(vf.Toolset[vf.ToolsetConfig, vf.State]):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @classmethod
    def toolsets(cls, config):
        return [AddTools(vf.ToolsetConfig(url=os.environ["E2E_VF_TOOLS_URL"]))]

    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == self.data.answer)


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        return [SumTask(SumData(prompt=f"{a}+{b}?", answer=str(a + b)), self.config.task)
                for a in range(1, 6) for b in range(1, 6)]


__all__ = ["SumTaskset"]


class AddWithTool(VerifiersEnvironment):
    ENV_ID = "vf_add_tool"


rows = AddWithTool.rows

if __name__ == "__main__":  # the tool server: python vf_add_tool.py (MCP_PORT_FILE names where its port goes)
    AddTools.run()
