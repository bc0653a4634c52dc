"""A verifiers 0.4.0 environment that fails on demand: its reward raises on the task "raise", and its
stop condition never returns on the task "hang"."""

import asyncio

import verifiers.v1 as vf

from aligner_ext.agents.verifiers_environment import VerifiersEnvironment


class OrderTask(vf.Task[vf.TaskData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        if self.data.prompt == "hang":
            await asyncio.Event().wait()
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def checked(self, trace: vf.Trace) -> float:
        if self.data.prompt == "raise":
            raise ValueError("asked to raise")
        return 1.0


class OrderTaskset(vf.Taskset[OrderTask, vf.TasksetConfig]):
    def load(self):
        return [OrderTask(vf.TaskData(prompt=prompt), self.config.task) for prompt in ("fine", "raise", "hang")]


__all__ = ["OrderTaskset"]


class Failing(VerifiersEnvironment):
    ENV_ID = "vf_failing"
