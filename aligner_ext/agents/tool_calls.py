"""Tool calls read from a model turn's sampled text, in the syntax of the model family's chat template.

A model calls tools in the format its chat template renders assistant `tool_calls` in, so the format
is read from the template text, not from a model name (the first format of FORMATS whose markers the
template holds):
- `qwen3_xml` (Qwen3.5, Qwen3.6, Qwen3-Coder, Nemotron 3; the template contains `<function=` and
  `<parameter=`): any number of
  `<tool_call>\\n<function=add>\\n<parameter=a>\\n1\\n</parameter>\\n</function>\\n</tool_call>`
  blocks. The template writes a string argument bare, so a value is read
  as JSON unless the tool's schema types its parameter as a string;
- `smollm3` (the template contains `xml_tools` and `<tool_call>`): Hermes blocks, but the template takes
  the tools from `xml_tools` and renders an assistant turn as its content alone, so the calls stay in
  the content as sampled;
- `hermes` (Qwen2.5, Qwen3, Hermes; the template contains `<tool_call>` and renders `tool_calls`): any
  number of `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks in one turn;
- `mistral` (Mistral 7B Instruct v0.3; the template contains `[TOOL_CALLS]`): the turn ends with
  `[TOOL_CALLS] [{"name": ..., "arguments": {...}, "id": "a1b2c3d4e"}, ...]`, each call with an id of 9
  letters or digits that its tool message quotes back (`tool_call_id`; the template refuses others);
- `llama3_json` (Llama 3.1 / 3.2; the template renders `"parameters"` and ends turns with
  `<|eot_id|>`): the whole turn is one `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`. A turn that starts with neither `{` nor the tag is a plain answer; several calls in
  one turn are one malformed attempt, as the template renders one call per turn and raises on more.

Any other template that renders no assistant `tool_calls` is refused (`tool_call_format`), naming the
family where it is recognised: Gemma 3 renders no tools; Phi-4-mini and OLMo 3 take tools, calls and
results through message fields of their own (docs/agents.md, "Tool-call formats"). A format also says
which template argument takes the tools (`template_tools`), which the renderer (tokens.py) uses.

A malformed call (bad JSON, no name, arguments that are not an object, a block never closed, a
Mistral id the template refuses) is kept as a `MalformedCall` in sampling order, with the problem
stated for the model: the tool runner answers it with an error observation and counts it; parsing
never raises.

The assistant message a turn becomes holds the text outside the well-formed calls as `content`
(malformed ones stay in it, as sampled) and the calls as OpenAI `tool_calls`: what the chat template
re-renders when the conversation continues (tokens.py compares that rendering with the sampled text
and reports a turn that renders otherwise instead of merging it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from aligner_ext.errors import ConfigError


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: a tool name, its arguments as a JSON object, and the id the model gave it
    (Mistral's; empty in formats without ids)."""

    name: str
    arguments: dict[str, Any]
    id: str = ""


@dataclass(frozen=True)
class MalformedCall:
    """A call the model attempted that cannot be run."""

    text: str  # the call as sampled
    problem: str  # what is wrong with it, as the error observation tells the model
    id: str = ""  # where the template needs every tool result to name a call (Mistral): the id its error answers


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
        and Mistral's templates treat a present key as a call)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [{"type": "function", "function": {"name": call.name, "arguments": call.arguments},
                                      **({"id": call.id} if call.id else {})} for call in self.tool_calls]
        return message


class ToolCallFormat:
    """One family's tool-call syntax: how its template is recognised, the special tokens that end a
    turn (stripped before parsing), and `parse`."""

    name: str
    markers: tuple[str, ...]  # strings the chat template contains, all of them (`tool_calls`: it renders the calls)
    end_of_turn: tuple[str, ...]

    def parse(self, text: str, tools: list[dict[str, Any]] | None = None) -> ParsedTurn:
        """Read the calls out of a turn's sampled text (decoded with its special tokens); `tools`, the
        episode's OpenAI tool schemas, type the arguments of formats that write them untyped."""
        for token in self.end_of_turn:
            if text.endswith(token):
                text = text[: -len(token)]
                break
        return self.parse_body(text, _parameter_schemas(tools))

    def parse_body(self, text: str, schemas: dict[str, dict[str, Any]]) -> ParsedTurn:
        raise NotImplementedError

    def template_tools(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        """The chat template's argument holding the episode's tools (OpenAI schemas)."""
        return {"tools": tools}


class HermesFormat(ToolCallFormat):
    """Qwen2.5 / Qwen3 / Hermes: `<tool_call>` blocks of JSON with "arguments", any number per turn."""

    name = "hermes"
    markers = ("<tool_call>", "tool_calls")
    end_of_turn = ("<|im_end|>", "<|endoftext|>")
    BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse_body(self, text: str, schemas: dict[str, dict[str, Any]]) -> ParsedTurn:
        calls, outside, start = [], [], 0
        for block in self.BLOCK.finditer(text):
            if block.group(0).endswith("</tool_call>"):
                call = self.read_block(block.group(1), schemas)
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

    def read_block(self, body: str, schemas: dict[str, dict[str, Any]]) -> ToolCall | MalformedCall:
        """One call from the text between <tool_call> and </tool_call>."""
        return _read_call(body, "arguments")


class Qwen3XmlFormat(HermesFormat):
    """Qwen3.5 / Qwen3.6 / Qwen3-Coder / Nemotron 3: `<tool_call>` blocks holding `<function=name>` and
    one `<parameter=key>` block per argument, its value on the lines between."""

    name = "qwen3_xml"
    markers = ("<tool_call>", "<function=", "<parameter=", "tool_calls")
    FUNCTION = re.compile(r"\s*<function=([^>\n]*)>\n(.*)</function>\s*\Z", re.DOTALL)
    PARAMETER = re.compile(r"<parameter=([^>\n]*)>\n(.*?)\n</parameter>\n", re.DOTALL)
    PYTHON_LITERALS = {"True": True, "False": False, "None": None}  # how Qwen3.5's `string` filter writes them

    def read_block(self, body: str, schemas: dict[str, dict[str, Any]]) -> ToolCall | MalformedCall:
        function = self.FUNCTION.match(body)
        if function is None:
            return MalformedCall(body, "the <tool_call> must hold one <function=name> ... </function> block")
        name, parameters = function.group(1).strip(), function.group(2)
        if not name:
            return MalformedCall(body, "the <function=...> has no name")
        arguments, at = {}, 0
        for parameter in self.PARAMETER.finditer(parameters):
            if parameters[at:parameter.start()].strip():
                break
            key = parameter.group(1).strip()
            arguments[key] = self._value(parameter.group(2), schemas.get(name, {}).get(key, {}))
            at = parameter.end()
        if parameters[at:].strip():
            return MalformedCall(body, "each argument must be a <parameter=name> block, its value on the lines "
                                       "between <parameter=name> and </parameter>: "
                                       f"{parameters[at:].strip()[:60]!r} is not")
        return ToolCall(name, arguments)

    def _value(self, text: str, schema: dict[str, Any]) -> Any:
        """A string where the schema allows one (the template writes strings unquoted), else the JSON
        (or Python literal) it spells; text that is neither stays a string for the tool's type check."""
        types = schema.get("type", [])
        if "string" in (types if isinstance(types, list) else [types]):
            return text
        if text in self.PYTHON_LITERALS:
            return self.PYTHON_LITERALS[text]
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text


class SmolLM3Format(HermesFormat):
    """SmolLM3: Hermes's `<tool_call>` JSON blocks, but its template takes the tools from `xml_tools` and
    renders an assistant turn as its content alone, never `tool_calls`: the calls stay in the content as
    sampled, and `tool_calls` lists them for the environment."""

    name = "smollm3"
    markers = ("xml_tools", "<tool_call>")

    def parse_body(self, text: str, schemas: dict[str, dict[str, Any]]) -> ParsedTurn:
        return ParsedTurn(text, super().parse_body(text, schemas).calls)

    def template_tools(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        """Each tool's function object, as SmolLM3's model card passes them (the template writes each
        with Jinja's `string` filter)."""
        return {"xml_tools": [tool["function"] for tool in tools]}


class MistralFormat(ToolCallFormat):
    """Mistral 7B Instruct v0.3: `[TOOL_CALLS]` then a JSON list of calls, each with a 9-character id."""

    name = "mistral"
    markers = ("[TOOL_CALLS]", "tool_calls")
    end_of_turn = ("</s>",)
    TOKEN = "[TOOL_CALLS]"
    ID = re.compile(r"[A-Za-z0-9]{9}\Z")

    def parse_body(self, text: str, schemas: dict[str, dict[str, Any]]) -> ParsedTurn:
        at = text.find(self.TOKEN)
        if at < 0:
            return ParsedTurn(text)
        body = text[at + len(self.TOKEN):].strip()
        try:
            items = json.loads(body)
        except json.JSONDecodeError as err:
            return ParsedTurn(text, [MalformedCall(body, f"the tool calls are not valid JSON ({err.msg} at character "
                                                         f"{err.pos})", self.stand_in_id(0))])
        if not isinstance(items, list) or not items:
            return ParsedTurn(text, [MalformedCall(body, "[TOOL_CALLS] must be followed by a JSON list of calls",
                                                   self.stand_in_id(0))])
        calls = [self._read_item(item, index) for index, item in enumerate(items)]
        good = any(isinstance(call, ToolCall) for call in calls)
        return ParsedTurn(text[:at].strip() if good else text, calls)

    def _read_item(self, item: Any, index: int) -> ToolCall | MalformedCall:
        """One call of the list; its text, where malformed, is the item written as JSON."""
        text = json.dumps(item)
        call = _call_from_object(item, "arguments", text)
        sampled_id = item.get("id") if isinstance(item, dict) else None
        valid_id = sampled_id if isinstance(sampled_id, str) and self.ID.match(sampled_id) else ""
        if isinstance(call, MalformedCall):
            return MalformedCall(text, call.problem, valid_id or self.stand_in_id(index))
        if not valid_id:
            return MalformedCall(text, 'the tool call\'s "id" must be 9 letters or digits', self.stand_in_id(index))
        return ToolCall(call.name, call.arguments, valid_id)

    @staticmethod
    def stand_in_id(index: int) -> str:
        """The id an error observation answers when the attempt has no valid one of its own (the
        template accepts only 9 letters or digits)."""
        return f"invalid{index:02d}"


class Llama3JsonFormat(ToolCallFormat):
    """Llama 3.1 / 3.2: the whole turn is one JSON call with "parameters", maybe after <|python_tag|>."""

    name = "llama3_json"
    markers = ('"parameters"', "<|eot_id|>", "tool_calls")
    end_of_turn = ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
    PYTHON_TAG = "<|python_tag|>"

    def parse_body(self, text: str, schemas: dict[str, dict[str, Any]]) -> ParsedTurn:
        body = text.strip()
        if body.startswith(self.PYTHON_TAG):
            body = body[len(self.PYTHON_TAG):]
        elif not body.startswith("{"):
            return ParsedTurn(text)
        if _json_values(body) > 1:
            return ParsedTurn(text, [MalformedCall(text, "Llama 3.1's chat template holds one tool call per turn: "
                                                         "call one tool, and the next after its result")])
        call = _read_call(body, "parameters")
        return ParsedTurn("", [call]) if isinstance(call, ToolCall) else ParsedTurn(text, [MalformedCall(text, call.problem)])


FORMATS: tuple[ToolCallFormat, ...] = (SmolLM3Format(), Qwen3XmlFormat(), HermesFormat(), MistralFormat(),
                                        Llama3JsonFormat())

# Templates that render no assistant `tool_calls`, by a string only that family's template holds:
# what each reads instead.
NO_CALLS = (
    ("<start_of_turn>", "Gemma 3's template renders no tools and no tool calls"),
    ("message['tools']", "Phi-4-mini's template reads tools as a JSON string in a system message's \"tools\" field "
                         "and writes an assistant turn's calls only as its content"),
    ("function_calls", "OLMo 3's template reads tools as a string in a message's \"functions\" field, calls as a "
                       "string in \"function_calls\" and results in \"environment\" messages"),
)

# Templates that render calls in a syntax not read yet, by a string that syntax holds.
UNREAD = (
    ("[ARGS]", "Mistral's newer `[TOOL_CALLS]name[ARGS]{...}` calls (Mistral Small 3.2, Magistral, Devstral) are not "
               "read yet"),
)


def _read_call(body: str, arguments_key: str) -> ToolCall | MalformedCall:
    """A call from its JSON text: an object with a string `name` and an object under `arguments_key`."""
    body = body.strip()
    try:
        value = json.loads(body)
    except json.JSONDecodeError as err:
        return MalformedCall(body, f"the tool call is not valid JSON ({err.msg} at character {err.pos})")
    return _call_from_object(value, arguments_key, body)


def _call_from_object(value: Any, arguments_key: str, text: str) -> ToolCall | MalformedCall:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return MalformedCall(text, 'the tool call has no "name" (a non-empty string)')
    if not isinstance(value.get(arguments_key), dict):
        return MalformedCall(text, f'the tool call\'s "{arguments_key}" must be a JSON object')
    return ToolCall(value["name"], value[arguments_key])


def _json_values(text: str) -> int:
    """How many JSON values the text holds one after another (separated by blanks or `;`, as Llama
    models write several calls); 0 where the first does not parse."""
    decoder, count, at = json.JSONDecoder(), 0, 0
    while at < len(text):
        try:
            _, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return count
        count += 1
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
    return count


def _parameter_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Tool name -> parameter name -> its JSON schema, from OpenAI tool schemas (a schema without them
    types nothing)."""
    functions = [tool.get("function") or {} for tool in tools or ()]
    return {function["name"]: (function.get("parameters") or {}).get("properties") or {}
            for function in functions if "name" in function}


def tool_call_format(tokenizer: Any) -> ToolCallFormat:
    """The tool-call format the tokenizer's chat template renders calls in (ConfigError when none)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates (e.g. "default", "tool_use"): any of them may define calls
        template = "\n".join(template.values())
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    for marker, reason in UNREAD:
        if marker in template:
            raise ConfigError(f"the chat template of tokenizer {name!r} renders tool calls in a syntax this library "
                              f"does not read: {reason}; docs/agents.md, \"Tool-call formats\", lists the formats read")
    for candidate in FORMATS:
        if all(marker in template for marker in candidate.markers):
            return candidate
    if "tool_calls" not in template:
        family = next((reason for marker, reason in NO_CALLS if marker in template), "")
        raise ConfigError(
            f"the chat template of tokenizer {name!r} renders no assistant tool_calls"
            + (f" ({family})" if family else "")
            + ", so an agent's tool calls cannot be read or trained on here; use a model whose chat template renders "
              "them (docs/agents.md, \"Tool-call formats\", lists the formats read)")
    raise ConfigError(
        f"the chat template of tokenizer {name!r} renders tool calls in no format this library reads: it contains "
        "neither <tool_call> (Qwen, Hermes), [TOOL_CALLS] (Mistral) nor Llama 3.1/3.2's JSON calls (\"parameters\" with "
        "<|eot_id|>); docs/agents.md, \"Tool-call formats\", lists the formats read")
