"""A single-turn verifiers 0.4.0 environment in the style of its `reverse_text` example: a taskset of
tasks "Say the digit d", one turn (`@vf.stop`), rewarded 1 when the reply is the digit (`@vf.reward`)."""

import verifiers.v1 as vf

from aligner_ext.agents.verifiers_environment import VerifiersEnvironment


class DigitData(vf.TaskData):
    answer: str


class DigitTask(vf.Task[DigitData]):
    @vf.stop
    async def single_turn(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 1

    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == self.data.answer)


class DigitTaskset(vf.Taskset[DigitTask, vf.TasksetConfig]):
    def load(self):
        return [DigitTask(DigitData(prompt=f"Say the digit {d}", system_prompt="Answer with one digit.", answer=str(d)),
                          self.config.task) for d in range(10)]


__all__ = ["DigitTaskset"]


class SayDigit(VerifiersEnvironment):
    """Ours: the taskset above, loaded by its module name."""

    ENV_ID = "vf_say_digit"


rows = SayDigit.rows
