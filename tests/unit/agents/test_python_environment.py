"""The `python` environment and its task `python_digits`: a scripted episode runs its call in the real
sandbox (agents/sandbox.py) and is scored on its boxed answer; the task's ground truths are the digit
sums worked out here; an environment that cannot run (a UserError) stops the run instead of failing
episodes one by one."""

import asyncio

import pytest

from aligner_ext.agents.environment import Environment, register_environment
from aligner_ext.agents.python_environment import PythonEnvironment
from aligner_ext.data.tasks import builtin_rows
from aligner_ext.data.types import PromptRow
from aligner_ext.errors import UserError

from tests.unit.agents.scripted import ScriptedPolicy, draws, run

ROW = PromptRow("p:0", [{"role": "user", "content": "What is the sum of the digits of 2**100? Run Python to find out; "
                                                    "answer in \\boxed{}."}], "python_digits", ground_truth="115")


def call(code):
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "python", "arguments": {"code": code}}}]}


def test_an_episode_runs_its_program_in_the_sandbox_and_is_scored_on_its_answer():
    async def episode():
        env = PythonEnvironment()
        state = (await env.reset(ROW)).state
        ran = await env.step(call("print(sum(map(int, str(2**100))))"), state)
        done = await env.step({"role": "assistant", "content": "It is \\boxed{115}."}, state)
        return ran, done, await env.score(state)

    ran, done, score = asyncio.run(episode())
    # 2**100 = 1267650600228229401496703205376, whose digits sum to 115
    assert ran.messages[0]["role"] == "tool" and "115" in ran.messages[0]["content"] and not ran.done
    assert done.done and (score.score, score.correct) == (1.0, 1.0)


def test_the_tasks_ground_truth_is_the_digit_sum_and_the_splits_are_apart():
    train, val = builtin_rows("python_digits", "train", 40, 0), builtin_rows("python_digits", "val", 40, 0)
    assert {r.messages[0]["content"] for r in train}.isdisjoint({r.messages[0]["content"] for r in val})
    for row in train + val:
        base, exponent = row.messages[0]["content"].split("digits of ")[1].split("?")[0].split("**")
        digits = str(int(base) ** int(exponent))
        assert row.ground_truth == str(sum(int(d) for d in digits)) and len(digits) >= 30
    assert builtin_rows("python_digits", "train", 40, 0) == train


@register_environment("test_cannot_run")
class CannotRun(Environment):
    async def reset(self, row):
        raise UserError("the sandbox cannot run here: unshare failed")


def test_an_environment_that_cannot_run_stops_the_run_with_its_line(qwen25_tokenizer):
    with pytest.raises(UserError, match="unshare failed"):
        run(ScriptedPolicy(qwen25_tokenizer, lambda text, seed: "1"), qwen25_tokenizer, draws((1, 1)),
            environment="test_cannot_run")
