"""Tools from typed functions: the schema chat templates take, and a runner that turns every failure
(unknown tool, bad arguments, an exception, a time-out, a malformed call) into a counted error
observation instead of an exception."""

import asyncio
import threading
from typing import Any, Literal

import pytest

from aligner_ext.agents.tool_calls import MalformedCall, ParsedTurn, ToolCall
from aligner_ext.agents.tools import ERRORS, ToolRunner, tool_schema


def lookup(key: Literal["x", "y"], default: Any = None) -> dict:
    """Look a key up.

    Args:
        key: Which key.
        default: What to give when it is missing.
    """
    return {"key": key, "value": default}


def run(coroutine):
    return asyncio.run(coroutine)


def test_the_schema_is_what_chat_templates_take(arithmetic):
    assert tool_schema(arithmetic["add"]) == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "The first number."},
            "b": {"type": "integer", "description": "The second number."}}, "required": ["a"]},
        "return": {"type": "integer"}}}

    def untyped(x):
        """No hints.

        Args:
            x: A thing.
        """

    with pytest.raises(ValueError, match="tool 'untyped' cannot be described to the model: .*type hint"):
        tool_schema(untyped)


def test_calls_return_the_output_as_text(arithmetic):
    runner = ToolRunner([arithmetic["add"], arithmetic["divide"], lookup])
    assert run(runner.call(ToolCall("add", {"a": 40}))).content == "42"
    assert run(runner.call(ToolCall("divide", {"a": 1, "b": 4}))).content == "0.25"
    result = run(runner.call(ToolCall("lookup", {"key": "x", "default": [1]})))
    assert (result.content, result.error) == ('{"key": "x", "value": [1]}', None)
    assert runner.counts == {"calls": 3}


@pytest.mark.parametrize("call, expected, reason", [
    (ToolCall("mul", {"a": 1}), "Error: unknown tool 'mul'; the tools are add, divide, lookup", "unknown_tool"),
    (ToolCall("add", {"b": 1}), "Error: bad arguments for add: missing a required argument: 'a'", "bad_arguments"),
    (ToolCall("add", {"a": 1, "c": 2}), "Error: bad arguments for add: got an unexpected keyword argument 'c'",
     "bad_arguments"),
    (ToolCall("add", {"a": "1"}), 'Error: bad arguments for add: a="1" is not of type integer', "bad_arguments"),
    (ToolCall("add", {"a": True}), "Error: bad arguments for add: a=true is not of type integer", "bad_arguments"),
    (ToolCall("lookup", {"key": "z"}), 'Error: bad arguments for lookup: key="z" is not one of ["x", "y"]',
     "bad_arguments"),
    (ToolCall("divide", {"a": 1, "b": 0}), "Error: divide raised ZeroDivisionError: division by zero", "exception"),
])
def test_every_failure_is_a_counted_error_observation(call, expected, reason, arithmetic):
    runner = ToolRunner([arithmetic["add"], arithmetic["divide"], lookup])
    result = run(runner.call(call))
    assert (result.content, result.error) == (expected, reason) and reason in ERRORS
    assert runner.counts == {"calls": 1, reason: 1}


def test_a_hung_tool_times_out_plain_or_async():
    released = threading.Event()

    def hang(x: int) -> int:
        """Wait until released.

        Args:
            x: Ignored.
        """
        released.wait(timeout=60)
        return x

    async def hang_async(x: int) -> int:
        """Never finish.

        Args:
            x: Ignored.
        """
        await asyncio.Event().wait()

    async def both():
        runner = ToolRunner([hang, hang_async], timeout_s=0.05)
        results = [await runner.call(ToolCall(name, {"x": 1})) for name in ("hang", "hang_async")]
        released.set()  # the plain tool's thread runs on after its time-out; let it end before the loop closes
        return runner, results

    runner, results = run(both())
    assert [(result.content, result.error) for result in results] == [
        ("Error: hang did not finish within 0.05 s", "timeout"), ("Error: hang_async did not finish within 0.05 s", "timeout")]
    assert runner.counts == {"calls": 2, "timeout": 2}


def test_a_turn_is_answered_in_call_order_with_calls_run_concurrently():
    """`first` waits for `second` to start: awaited one after the other, `first` would time out."""

    async def turn():
        started = asyncio.Event()

        async def first(x: int) -> str:
            """Wait for the second call.

            Args:
                x: Echoed.
            """
            await started.wait()
            return f"first {x}"

        async def second(x: int) -> str:
            """Let the first call finish.

            Args:
                x: Echoed.
            """
            started.set()
            return f"second {x}"

        runner = ToolRunner([first, second], timeout_s=30)
        parsed = ParsedTurn("", [ToolCall("first", {"x": 1}), MalformedCall("<tool_call>{", "not valid JSON"),
                                 ToolCall("second", {"x": 2})])
        return runner, await runner.answer(parsed)

    runner, messages = run(turn())
    assert messages == [{"role": "tool", "name": "first", "content": "first 1"},
                        {"role": "tool", "name": "", "content": "Error: malformed tool call: not valid JSON"},
                        {"role": "tool", "name": "second", "content": "second 2"}]
    assert runner.counts == {"calls": 3, "malformed": 1}


def test_two_tools_of_one_name_are_refused(arithmetic):
    with pytest.raises(ValueError, match="two tools share a name"):
        ToolRunner([arithmetic["add"], arithmetic["add"]])
