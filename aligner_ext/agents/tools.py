"""Tools from typed Python functions, and the runner that answers a model turn's calls.

A tool is a function with type hints and a Google-style docstring (`Args:` naming every argument):
its schema is what transformers' `get_json_schema` makes of it, the same JSON that chat templates
take as `tools=` and render into the prompt, so the model is shown exactly what the runner accepts.

The runner never raises on a call. An unknown tool, arguments that do not fit the signature or the
schema's JSON types, an exception in the tool, a call over the time limit, and a malformed call
(tool_calls.py) each become an error observation, a string the model reads in the tool message,
counted in `ToolRunner.counts` under its reason. The time limit stops waiting, not the work: a plain
function keeps running in its worker thread after it times out (Python cannot stop a thread) and holds
that worker, and the event loop's shutdown waits for it; code that may hang or must be contained
belongs in a separate process: sandbox.py runs model-written Python so, and a time-out of its `python`
tool stops the program.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from transformers.utils import get_json_schema

from aligner_ext.agents.tool_calls import MalformedCall, ParsedTurn, ToolCall

JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),),
}
ERRORS = ("unknown_tool", "bad_arguments", "exception", "timeout", "malformed")  # the reasons counted


def tool_schema(function: Callable[..., Any]) -> dict[str, Any]:
    """The function's JSON schema as chat templates take it; ValueError naming the function when its
    hints or docstring cannot describe it."""
    try:
        return get_json_schema(function)
    except Exception as err:  # transformers raises its own parsing exceptions, subclasses of Exception only
        raise ValueError(f"tool {getattr(function, '__name__', function)!r} cannot be described to the model: {err} "
                         "(a tool needs a type hint on every argument and a docstring with an Args: section)") from err


@dataclass
class ToolResult:
    """One call's observation: the tool's output, or the error the model is told."""

    content: str
    error: str | None = None  # None, or one of ERRORS
    seconds: float = 0.0  # wall time of the call, for the tool-latency metric


class ToolRunner:
    """Runs the calls of a model turn against a fixed set of tool functions (async or plain)."""

    def __init__(self, functions: list[Callable[..., Any]], timeout_s: float = 30.0):
        self.functions = {function.__name__: function for function in functions}
        if len(self.functions) != len(functions):
            raise ValueError(f"two tools share a name: {sorted(function.__name__ for function in functions)}")
        self.schemas = [tool_schema(function) for function in functions]  # what the chat template shows the model
        self.properties = {schema["function"]["name"]: schema["function"]["parameters"]["properties"]
                           for schema in self.schemas}  # argument name -> its JSON schema, per tool
        self.timeout_s = timeout_s
        self.counts: Counter[str] = Counter()  # "calls" and each error reason

    async def answer(self, turn: ParsedTurn) -> list[dict[str, Any]]:
        """One tool message per call attempt of the turn, in the order sampled; the calls run concurrently."""
        return [tool_message(call, result) for call, result in zip(turn.calls, await self.run(turn))]

    async def run(self, turn: ParsedTurn) -> list[ToolResult]:
        """The result of every call attempt of the turn, in the order sampled; the calls run concurrently."""
        return await asyncio.gather(*(self.call(call) if isinstance(call, ToolCall) else self.malformed(call)
                                      for call in turn.calls))

    async def malformed(self, call: MalformedCall) -> ToolResult:
        return self._counted(ToolResult(f"Error: malformed tool call: {call.problem}", "malformed"))

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one call within the time limit; every failure is an error observation."""
        function = self.functions.get(call.name)
        if function is None:
            return self._counted(ToolResult(f"Error: unknown tool {call.name!r}; the tools are "
                                            f"{', '.join(sorted(self.functions))}", "unknown_tool"))
        problem = self._argument_problem(call)
        if problem:
            return self._counted(ToolResult(f"Error: bad arguments for {call.name}: {problem}", "bad_arguments"))
        start = time.monotonic()
        work = function(**call.arguments) if inspect.iscoroutinefunction(function) else \
            asyncio.to_thread(function, **call.arguments)
        try:
            output = await asyncio.wait_for(work, self.timeout_s)
        except asyncio.TimeoutError:
            result = ToolResult(f"Error: {call.name} did not finish within {self.timeout_s:g} s", "timeout")
        except Exception as err:  # the tool's own failure is the model's observation, never the run's
            result = ToolResult(f"Error: {call.name} raised {type(err).__name__}: {err}", "exception")
        else:
            result = ToolResult(output if isinstance(output, str) else json.dumps(output, default=str))
        result.seconds = time.monotonic() - start
        return self._counted(result)

    def _argument_problem(self, call: ToolCall) -> str | None:
        """Why the arguments cannot be passed: not matching the signature, or a value of the wrong JSON type."""
        try:
            inspect.signature(self.functions[call.name]).bind(**call.arguments)
        except TypeError as err:
            return str(err)
        for name, value in call.arguments.items():
            spec = self.properties[call.name][name]
            if "type" not in spec:  # an `Any` hint: nothing to check
                continue
            types = spec["type"] if isinstance(spec["type"], list) else [spec["type"]]
            types += ["null"] if spec.get("nullable") else []
            if not any(_is_json_type(value, kind) for kind in types):
                return f"{name}={json.dumps(value)} is not of type {' or '.join(types)}"
            if "enum" in spec and value not in spec["enum"] and value is not None:
                return f"{name}={json.dumps(value)} is not one of {json.dumps(spec['enum'])}"
        return None

    def _counted(self, result: ToolResult) -> ToolResult:
        self.counts["calls"] += 1
        if result.error:
            self.counts[result.error] += 1
        return result


def tool_message(call: ToolCall | MalformedCall, result: ToolResult) -> dict[str, Any]:
    """The tool message that answers one call attempt (a malformed call has no name), quoting the call's
    id where the format has ids (Mistral's template requires them)."""
    message = {"role": "tool", "name": getattr(call, "name", ""), "content": result.content}
    if call.id:
        message["tool_call_id"] = call.id
    return message


def _is_json_type(value: Any, kind: str) -> bool:
    """JSON Schema's type test (booleans are not numbers)."""
    if isinstance(value, bool) and kind in ("integer", "number"):
        return False
    return isinstance(value, JSON_TYPES[kind])
