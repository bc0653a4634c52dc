"""Tool calls read from a model turn's sampled text, in the syntax of the model family's chat template.

A model calls tools in the format its chat template renders assistant `tool_calls` in, so the format
is read from the template text, not from a model name:
- `hermes` (Qwen2.5, Qwen3, Hermes; the template contains `<tool_call>`): any number of
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks in one turn;
- `llama3_json` (Llama 3.1 / 3.2; the template renders `"parameters"` and ends turns with
  `<|eot_id|>`): the whole turn is one `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`. A turn that starts with neither `{` nor the tag is a plain answer.

A malformed call (bad JSON, no name, arguments that are not an object, a `<tool_call>` never
closed) is kept as a `MalformedCall` in sampling order, with the problem stated for the model: the
tool runner answers it with an error observation and counts it; parsing never raises.

The assistant message a turn becomes holds the text outside the well-formed calls as `content`
(malformed ones stay in it, as sampled) and the calls as OpenAI `tool_calls`: what the chat template
re-renders when the conversation continues (tokens.py compares that rendering with the sampled text).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from aligner_ext.errors import ConfigError


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: a tool name and its arguments as a JSON object."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class MalformedCall:
    """A call the model attempted that cannot be run."""

    text: str  # the call as sampled
    problem: str  # what is wrong with it, as the error observation tells the model


@dataclass
class ParsedTurn:
    """One model turn: its text outside the calls, and every call attempt in sampling order."""

    content: str
    calls: list[ToolCall | MalformedCall] = field(default_factory=list)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [call for call in self.calls if isinstance(call, ToolCall)]

    @property
    def malformed(self) -> list[MalformedCall]:
        return [call for call in self.calls if isinstance(call, MalformedCall)]

    def message(self) -> dict[str, Any]:
        """The turn as an OpenAI assistant message (`tool_calls` only when there are any: Llama 3.1's
        template treats a present key as a call)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [{"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                                     for call in self.tool_calls]
        return message


class ToolCallFormat:
    """One family's tool-call syntax: how its template is recognised, the special tokens that end a
    turn (stripped before parsing), and `parse`."""

    name: str
    markers: tuple[str, ...]  # strings the chat template contains, all of them
    end_of_turn: tuple[str, ...]

    def parse(self, text: str) -> ParsedTurn:
        """Read the calls out of a turn's sampled text (decoded with its special tokens)."""
        for token in self.end_of_turn:
            if text.endswith(token):
                text = text[: -len(token)]
                break
        return self.parse_body(text)

    def parse_body(self, text: str) -> ParsedTurn:
        raise NotImplementedError


class HermesFormat(ToolCallFormat):
    """Qwen2.5 / Qwen3 / Hermes: `<tool_call>` blocks of JSON with "arguments", any number per turn."""

    name = "hermes"
    markers = ("<tool_call>",)
    end_of_turn = ("<|im_end|>", "<|endoftext|>")
    BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse_body(self, text: str) -> ParsedTurn:
        calls, outside, start = [], [], 0
        for block in self.BLOCK.finditer(text):
            if block.group(0).endswith("</tool_call>"):
                call = _read_call(block.group(1), "arguments")
            else:
                call = MalformedCall(block.group(0), "the <tool_call> is never closed with </tool_call>")
            if isinstance(call, ToolCall):
                outside.append(text[start:block.start()])
            else:  # kept in the content as sampled
                call = MalformedCall(block.group(0), call.problem)
                outside.append(text[start:block.end()])
            calls.append(call)
            start = block.end()
        content = "".join(outside) + text[start:]
        # the template writes the newlines around each call itself: a turn of calls alone has empty content
        return ParsedTurn(content.strip() if any(isinstance(call, ToolCall) for call in calls) else content, calls)


class Llama3JsonFormat(ToolCallFormat):
    """Llama 3.1 / 3.2: the whole turn is one JSON call with "parameters", maybe after <|python_tag|>."""

    name = "llama3_json"
    markers = ('"parameters"', "<|eot_id|>")
    end_of_turn = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
    PYTHON_TAG = "<|python_tag|>"

    def parse_body(self, text: str) -> ParsedTurn:
        body = text.strip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):]
        elif not body.startswith("{"):
            return ParsedTurn(text)
        call = _read_call(body, "parameters")
        return ParsedTurn("", [call]) if isinstance(call, ToolCall) else ParsedTurn(text, [MalformedCall(text, call.problem)])


FORMATS: tuple[ToolCallFormat, ...] = (HermesFormat(), Llama3JsonFormat())


def _read_call(body: str, arguments_key: str) -> ToolCall | MalformedCall:
    """A call from its JSON text: an object with a string `name` and an object under `arguments_key`."""
    body = body.strip()
    try:
        value = json.loads(body)
    except json.JSONDecodeError as err:
        return MalformedCall(body, f"the tool call is not valid JSON ({err.msg} at character {err.pos})")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return MalformedCall(body, 'the tool call has no "name" (a non-empty string)')
    if not isinstance(value.get(arguments_key), dict):
        return MalformedCall(body, f'the tool call\'s "{arguments_key}" must be a JSON object')
    return ToolCall(value["name"], value[arguments_key])


def tool_call_format(tokenizer: Any) -> ToolCallFormat:
    """The tool-call format the tokenizer's chat template renders calls in (ConfigError when none)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates (e.g. "default", "tool_use"): any of them may define calls
        template = "\n".join(template.values())
    for candidate in FORMATS:
        if all(marker in template for marker in candidate.markers):
            return candidate
    raise ConfigError(
        f"the chat template of tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} "
        "defines no tool-call format this library reads: it contains neither <tool_call> (Qwen2.5, Qwen3, Hermes) "
        "nor Llama 3.1/3.2's JSON calls (\"parameters\" with <|eot_id|>); use a model whose chat template renders "
        "tool calls")
