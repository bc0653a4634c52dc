"""Tool calls read from sampled text in each family's syntax, the format chosen from the chat template,
malformed calls kept (in order, with the problem) instead of raised, and, on each family's own chat
template (tests/fixtures/chat_templates/), a parsed turn re-rendering to its sampled text or reported
as a rewrite where the template writes it otherwise. Expected renderings are written out by hand from
the templates."""

import asyncio

import pytest

from aligner_ext.agents.tokens import ChatRenderer
from aligner_ext.agents.tool_calls import (HermesFormat, Llama3JsonFormat, MalformedCall, MistralFormat, Qwen3XmlFormat,
                                           ToolCall, tool_call_format)
from aligner_ext.agents.tools import ToolRunner
from aligner_ext.errors import ConfigError
from aligner_ext.models.tiny import build_char_tokenizer
from tests.unit.agents.conftest import GEMMA_SPECIAL, QWEN_SPECIAL, chat_tokenizer

ADD = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
MUL = '{"name": "mul", "arguments": {"a": 3, "b": 4}}'


def test_the_format_is_read_from_the_chat_template(qwen25_tokenizer, qwen3_tokenizer, llama31_tokenizer):
    assert tool_call_format(qwen25_tokenizer).name == "hermes"
    assert tool_call_format(qwen3_tokenizer).name == "hermes"
    assert tool_call_format(llama31_tokenizer).name == "llama3_json"
    assert tool_call_format(build_char_tokenizer()).name == "hermes"  # the embedded model's template
    plain = build_char_tokenizer()
    plain.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                           "{% endfor %}")
    with pytest.raises(ConfigError, match="renders no assistant tool_calls, so an agent's tool calls cannot be read"):
        tool_call_format(plain)  # plain ChatML renders no calls


def test_hermes_reads_several_calls_and_the_text_around_them():
    turn = HermesFormat().parse(f"Let me compute.\n<tool_call>\n{ADD}\n</tool_call>\n<tool_call>\n{MUL}\n</tool_call><|im_end|>")
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("mul", {"a": 3, "b": 4})]
    assert turn.content == "Let me compute." and turn.malformed == []
    assert turn.message() == {"role": "assistant", "content": "Let me compute.", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
        {"type": "function", "function": {"name": "mul", "arguments": {"a": 3, "b": 4}}}]}


def test_a_turn_without_calls_is_its_text_exactly():
    turn = HermesFormat().parse("The answer is 3.\n<|im_end|>")
    assert turn.calls == [] and turn.message() == {"role": "assistant", "content": "The answer is 3.\n"}


@pytest.mark.parametrize("body, problem", [
    # the stray comma is character 37 of the JSON: {"name": "add", "arguments": {"a": 1,}}
    ('{"name": "add", "arguments": {"a": 1,}}', "not valid JSON (Expecting property name enclosed in double quotes at character 37)"),
    ('{"arguments": {"a": 1}}', 'has no "name"'),
    ('["add"]', 'has no "name"'),
    ('{"name": "add", "arguments": "a=1"}', '"arguments" must be a JSON object'),
    ('{"name": "add"}', '"arguments" must be a JSON object'),
])
def test_hermes_malformed_calls_are_kept_with_their_problem(body, problem):
    text = f"<tool_call>\n{ADD}\n</tool_call>\n<tool_call>\n{body}\n</tool_call><|im_end|>"
    turn = HermesFormat().parse(text)
    assert turn.calls[0] == ToolCall("add", {"a": 1, "b": 2})
    assert isinstance(turn.calls[1], MalformedCall) and problem in turn.calls[1].problem
    assert turn.calls[1].text == f"<tool_call>\n{body}\n</tool_call>"
    assert turn.content == f"<tool_call>\n{body}\n</tool_call>"  # the malformed call stays in the text


def test_hermes_an_unclosed_call_is_malformed_and_text_stays_as_sampled():
    text = f"Thinking.\n<tool_call>\n{ADD}"
    turn = HermesFormat().parse(text)
    assert turn.calls == [MalformedCall(f"<tool_call>\n{ADD}", "the <tool_call> is never closed with </tool_call>")]
    assert turn.content == text and "tool_calls" not in turn.message()


def test_llama_reads_one_json_call_with_or_without_the_python_tag():
    for text in ('{"name": "add", "parameters": {"a": 1, "b": 2}}<|eot_id|>',
                 '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}<|eom_id|>'):
        turn = Llama3JsonFormat().parse(text)
        assert turn.calls == [ToolCall("add", {"a": 1, "b": 2})] and turn.content == ""
    answer = Llama3JsonFormat().parse("It is 3.<|eot_id|>")
    assert answer.calls == [] and answer.content == "It is 3."


@pytest.mark.parametrize("text, problem", [
    ('{"name": "add", "parameters": {"a": 1}', "not valid JSON"),
    ('<|python_tag|>add(a=1)', "not valid JSON"),
    ('{"name": "add", "arguments": {"a": 1}}', '"parameters" must be a JSON object'),
    ('{"name": "", "parameters": {}}', 'has no "name"'),
])
def test_llama_malformed_calls(text, problem):
    turn = Llama3JsonFormat().parse(text + "<|eot_id|>")
    assert len(turn.malformed) == 1 and problem in turn.malformed[0].problem
    assert turn.content == text and "tool_calls" not in turn.message()


def test_the_newer_formats_are_read_from_their_templates(qwen35_tokenizer, mistral_tokenizer):
    assert tool_call_format(qwen35_tokenizer).name == "qwen3_xml"  # its template also holds <tool_call>: not hermes
    assert tool_call_format(mistral_tokenizer).name == "mistral"


@pytest.mark.parametrize("template, family", [
    ("gemma3.jinja", "Gemma 3's template renders no tools and no tool calls"),
    ("phi4_mini.jinja", "Phi-4-mini's template reads tools as a JSON string in a system message's \"tools\" field"),
    ("olmo3.jinja", "OLMo 3's template reads tools as a string in a message's \"functions\" field"),
])
def test_templates_that_render_no_tool_calls_are_refused_naming_the_family(template, family):
    tokenizer = chat_tokenizer(template, GEMMA_SPECIAL + QWEN_SPECIAL, [], eos="<eos>")
    with pytest.raises(ConfigError) as refusal:
        tool_call_format(tokenizer)
    assert "renders no assistant tool_calls" in str(refusal.value) and family in str(refusal.value)


SMOLLM3_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def test_a_smollm3_turn_keeps_its_calls_in_the_content_and_its_tools_reach_the_prompt(arithmetic):
    """SmolLM3's template takes tools from `xml_tools` (its `tools=` is ignored) and renders an assistant
    turn as its content alone: the turn re-renders as sampled only with the calls kept in the content."""
    tokenizer = chat_tokenizer("smollm3.jinja", QWEN_SPECIAL, ["<tool_call>", "</tool_call>", "<think>", "</think>"],
                               eos="<|im_end|>")
    runner = ToolRunner([arithmetic["add"]])
    assert tool_call_format(tokenizer).name == "smollm3"
    renderer = ChatRenderer(tokenizer, runner.schemas, enable_thinking=False)
    trajectory = renderer.start([{"role": "user", "content": "What is 1+2?"}])
    # the function object written with Jinja's `string` filter, i.e. Python's repr
    assert "<tools>\n{'name': 'add', 'description': 'Add two integers.', 'parameters': {'type': 'object'" in (
        trajectory.text)
    assert trajectory.text.endswith(
        "<|im_start|>user\nWhat is 1+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n")
    text = f"Let me add.\n{SMOLLM3_CALL}<|im_end|>"
    turn = tool_call_format(tokenizer).parse(text, runner.schemas)
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2})] and turn.content == f"Let me add.\n{SMOLLM3_CALL}"
    renderer.add_turn(trajectory, tokenizer(text, add_special_tokens=False)["input_ids"], turn.message())
    extension = renderer.add_messages(trajectory, asyncio.run(runner.answer(turn)))
    assert not extension.rewrites_history and extension.template_ids == [tokenizer.convert_tokens_to_ids("\n")]
    # a tool result is rendered as a user message
    assert tokenizer.decode(extension.observation_ids) == (
        "<|im_start|>user\n3<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n")
    assert tokenizer.decode(trajectory.ids) == renderer.render(trajectory.messages, add_generation_prompt=True)


def test_mistrals_newer_name_args_calls_are_refused_not_misread(mistral_tokenizer):
    newer = chat_tokenizer("mistral.jinja", [], [], eos="</s>")
    newer.chat_template = mistral_tokenizer.chat_template.replace(
        "{{- \"[TOOL_CALLS] [\" }}", "{{- \"[TOOL_CALLS]\" + message.tool_calls[0].function.name + \"[ARGS]\" }}")
    with pytest.raises(ConfigError, match=r"Mistral's newer `\[TOOL_CALLS\]name\[ARGS\]\{...\}` calls .* not read yet"):
        tool_call_format(newer)


def test_llama_several_calls_in_one_turn_are_one_malformed_attempt(llama31_tokenizer, arithmetic):
    """Llama 3.1's template raises on an assistant message with two tool_calls: the turn stays text."""
    for separator in ("; ", "\n"):
        text = '{"name": "add", "parameters": {"a": 1}}' + separator + '{"name": "mul", "parameters": {"a": 3, "b": 4}}'
        turn = Llama3JsonFormat().parse(text + "<|eot_id|>")
        assert turn.calls == [MalformedCall(text, "Llama 3.1's chat template holds one tool call per turn: call one "
                                                  "tool, and the next after its result")]
        assert turn.message() == {"role": "assistant", "content": text}
    renderer = ChatRenderer(llama31_tokenizer, ToolRunner([arithmetic["add"]]).schemas)
    trajectory = renderer.start([{"role": "user", "content": "What is 1+2 and 3*4?"}])
    sampled = llama31_tokenizer(text + "<|eot_id|>", add_special_tokens=False)["input_ids"]
    renderer.add_turn(trajectory, sampled, turn.message())
    extension = renderer.add_messages(trajectory, [{"role": "tool", "content": "Error: malformed tool call"}])
    assert not extension.rewrites_history  # the text re-renders as sampled; the template does not raise


def test_a_llama_call_after_the_python_tag_is_read_and_its_re_rendering_reported(llama31_tokenizer, arithmetic):
    """Without built-in tools Llama 3.1's template writes a call as the bare JSON: the tag is not re-rendered."""
    renderer = ChatRenderer(llama31_tokenizer, ToolRunner([arithmetic["add"]]).schemas)
    trajectory = renderer.start([{"role": "user", "content": "What is 1+2?"}])
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}<|eom_id|>'
    turn = Llama3JsonFormat().parse(text)
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2})]
    renderer.add_turn(trajectory, llama31_tokenizer(text, add_special_tokens=False)["input_ids"], turn.message())
    extension = renderer.add_messages(trajectory, [{"role": "tool", "content": "3"}])
    assert extension.rewrites_history and "<|python_tag|>{" in extension.reason


QWEN35_CALLS = ("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n"
                "</function>\n</tool_call>\n<tool_call>\n<function=repeat>\n<parameter=text>\n12\n</parameter>\n"
                "<parameter=times>\n2\n</parameter>\n</function>\n</tool_call>")


def repeat(text: str, times: int) -> str:
    """Repeat a text.

    Args:
        text: What to repeat.
        times: How many times.
    """
    return text * times


def flag(on: bool) -> str:
    """Set a flag.

    Args:
        on: Whether it is on.
    """
    return "on" if on else "off"


def test_qwen35_xml_calls_are_typed_by_the_schema():
    schemas = ToolRunner([repeat]).schemas
    turn = Qwen3XmlFormat().parse(f"I will call both.\n\n{QWEN35_CALLS}<|im_end|>", schemas)
    # "12" is text for repeat (its schema says string); the same digits are the number 12 without a schema
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("repeat", {"text": "12", "times": 2})]
    assert turn.content == "I will call both."
    untyped = Qwen3XmlFormat().parse(QWEN35_CALLS)
    assert untyped.calls[1] == ToolCall("repeat", {"text": 12, "times": 2})
    multiline = Qwen3XmlFormat().parse("<tool_call>\n<function=repeat>\n<parameter=text>\nab\ncd\n</parameter>\n"
                                       "</function>\n</tool_call>", schemas)
    assert multiline.calls == [ToolCall("repeat", {"text": "ab\ncd"})]


@pytest.mark.parametrize("block, problem", [
    ("<tool_call>\n{\"name\": \"add\", \"arguments\": {}}\n</tool_call>", "must hold one <function=name> ... </function>"),
    ("<tool_call>\n<function=>\n</function>\n</tool_call>", "the <function=...> has no name"),
    ("<tool_call>\n<function=add>\n<parameter=a>\n1\n</function>\n</tool_call>",
     "each argument must be a <parameter=name> block, its value on the lines between <parameter=name> and "
     "</parameter>: '<parameter=a>\\n1' is not"),
    ("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n", "the <tool_call> is never closed"),
])
def test_qwen35_malformed_xml_calls(block, problem):
    turn = Qwen3XmlFormat().parse(f"{QWEN35_CALLS}\n{block}<|im_end|>")
    assert len(turn.tool_calls) == 2 and len(turn.malformed) == 1 and problem in turn.malformed[0].problem
    assert turn.content == block.strip()  # the malformed block stays in the text, as sampled


def test_a_qwen35_turn_of_xml_calls_re_renders_to_its_sampled_text(qwen35_tokenizer, arithmetic):
    tokenizer, runner = qwen35_tokenizer, ToolRunner([arithmetic["add"], repeat])
    renderer = ChatRenderer(tokenizer, runner.schemas)
    trajectory = renderer.start([{"role": "user", "content": "Add 1 and 2, and repeat 12 twice."}])
    assert trajectory.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off by default
    sampled = tokenizer(f"I will call both.\n\n{QWEN35_CALLS}<|im_end|>", add_special_tokens=False)["input_ids"]
    turn = tool_call_format(tokenizer).parse(tokenizer.decode(sampled, skip_special_tokens=False), runner.schemas)
    renderer.add_turn(trajectory, sampled, turn.message())
    tool_messages = asyncio.run(runner.answer(turn))
    assert [message["content"] for message in tool_messages] == ["3", "1212"]
    extension = renderer.add_messages(trajectory, tool_messages)
    assert not extension.rewrites_history and extension.template_ids == [tokenizer.convert_tokens_to_ids("\n")]
    assert tokenizer.decode(extension.observation_ids) == (
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n1212\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tokenizer.decode(trajectory.ids) == renderer.render(trajectory.messages, add_generation_prompt=True)


def test_a_qwen3_coder_turn_of_xml_calls_re_renders_to_its_sampled_text(arithmetic):
    """Qwen3-Coder's template: the same calls as Qwen3.5's, no thinking block, tool results each closed by a newline."""
    tokenizer = chat_tokenizer("qwen3_coder.jinja", QWEN_SPECIAL, ["<tool_call>", "</tool_call>"], eos="<|im_end|>")
    runner = ToolRunner([arithmetic["add"], repeat])
    assert tool_call_format(tokenizer).name == "qwen3_xml"
    renderer = ChatRenderer(tokenizer, runner.schemas)
    trajectory = renderer.start([{"role": "user", "content": "Add 1 and 2, and repeat 12 twice."}])
    assert "<function>\n<name>repeat</name>" in trajectory.text and trajectory.text.endswith("<|im_start|>assistant\n")
    text = f"I will call both.\n\n{QWEN35_CALLS}<|im_end|>"
    turn = tool_call_format(tokenizer).parse(text, runner.schemas)
    renderer.add_turn(trajectory, tokenizer(text, add_special_tokens=False)["input_ids"], turn.message())
    extension = renderer.add_messages(trajectory, asyncio.run(runner.answer(turn)))
    assert not extension.rewrites_history and extension.template_ids == [tokenizer.convert_tokens_to_ids("\n")]
    assert tokenizer.decode(extension.observation_ids) == (
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n1212\n</tool_response>\n<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_qwen35_writes_booleans_as_python_so_a_sampled_true_is_reported_as_a_rewrite(qwen35_tokenizer):
    """Qwen3.5's template writes a non-string argument through `string`: True, not the JSON true."""
    tokenizer, schemas = qwen35_tokenizer, ToolRunner([flag]).schemas
    for value, rewrites in (("True", False), ("true", True)):
        renderer = ChatRenderer(tokenizer, schemas)
        trajectory = renderer.start([{"role": "user", "content": "Turn it on."}])
        text = f"<tool_call>\n<function=flag>\n<parameter=on>\n{value}\n</parameter>\n</function>\n</tool_call><|im_end|>"
        turn = Qwen3XmlFormat().parse(text, schemas)
        assert turn.calls == [ToolCall("flag", {"on": True})]
        renderer.add_turn(trajectory, tokenizer(text, add_special_tokens=False)["input_ids"], turn.message())
        extension = renderer.add_messages(trajectory, [{"role": "tool", "content": "on"}])
        assert extension.rewrites_history == rewrites
    assert "<parameter=on>\\ntrue" in extension.reason and "<parameter=on>\\nTrue" in extension.reason


ADD_CALLS = '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "call00001"}]'


def test_mistral_reads_a_list_of_calls_with_their_ids():
    text = ADD_CALLS[:-1] + ', {"name": "mul", "arguments": {"a": 3, "b": 4}, "id": "Zz9Zz9Zz9"}]</s>'
    turn = MistralFormat().parse(text)
    assert turn.calls == [ToolCall("add", {"a": 1, "b": 2}, "call00001"), ToolCall("mul", {"a": 3, "b": 4}, "Zz9Zz9Zz9")]
    assert turn.message()["tool_calls"][1] == {"type": "function", "id": "Zz9Zz9Zz9",
                                               "function": {"name": "mul", "arguments": {"a": 3, "b": 4}}}
    assert MistralFormat().parse(" It is 3.</s>").message() == {"role": "assistant", "content": " It is 3."}


@pytest.mark.parametrize("body, problem, call_id", [
    ('[{"name": "add", "arguments": {"a": 1}}]', 'the tool call\'s "id" must be 9 letters or digits', "invalid00"),
    ('[{"name": "add", "arguments": {"a": 1}, "id": "call-0001"}]', '"id" must be 9 letters or digits', "invalid00"),
    ('[{"name": "add", "arguments": 1, "id": "call00001"}]', '"arguments" must be a JSON object', "call00001"),
    ('[{"name": "add", "arguments": {"a": 1}, "id": "call00001"', "not valid JSON (Expecting ',' delimiter",
     "invalid00"),
    ('{"name": "add", "arguments": {"a": 1}, "id": "call00001"}', "must be followed by a JSON list of calls",
     "invalid00"),
])
def test_mistral_malformed_calls_get_an_id_the_template_accepts(body, problem, call_id):
    turn = MistralFormat().parse(f"[TOOL_CALLS] {body}</s>")
    assert len(turn.malformed) == 1 and problem in turn.malformed[0].problem
    assert turn.malformed[0].id == call_id and turn.content == f"[TOOL_CALLS] {body}"


# v0.3's template writes a space after [INST], [TOOL_CALLS], [TOOL_RESULTS] and before an answer; the tekken one none
MISTRAL_TEMPLATES = [("mistral_tokenizer", " "), ("mistral_tekken_tokenizer", "")]


@pytest.mark.parametrize("tokenizer_fixture, space", MISTRAL_TEMPLATES)
def test_a_mistral_episode_re_renders_its_calls_and_answers_each_id(tokenizer_fixture, space, request, arithmetic):
    tokenizer, runner = request.getfixturevalue(tokenizer_fixture), ToolRunner([arithmetic["add"]])
    assert tool_call_format(tokenizer).name == "mistral"
    renderer = ChatRenderer(tokenizer, runner.schemas)
    trajectory = renderer.start([{"role": "user", "content": "What is 1+2?"}])
    assert trajectory.text.startswith(f'<s>[AVAILABLE_TOOLS]{space}[{{"type": "function", "function": {{"name": "add"')
    assert trajectory.text.endswith(f"[/AVAILABLE_TOOLS][INST]{space}What is 1+2?[/INST]")
    calls = f'[TOOL_CALLS]{space}[{{"name": "add", "arguments": {{"a": 1, "b": 2}}, "id": "call00001"}}]</s>'
    sampled = tokenizer(calls, add_special_tokens=False)["input_ids"]
    turn = tool_call_format(tokenizer).parse(tokenizer.decode(sampled, skip_special_tokens=False))
    renderer.add_turn(trajectory, sampled, turn.message())
    tool_messages = asyncio.run(runner.answer(turn))
    assert tool_messages == [{"role": "tool", "name": "add", "content": "3", "tool_call_id": "call00001"}]
    extension = renderer.add_messages(trajectory, tool_messages)
    # the template writes no generation prompt: the model continues after the results
    assert not extension.rewrites_history and extension.template_ids == []
    assert tokenizer.decode(extension.observation_ids) == (
        f'[TOOL_RESULTS]{space}{{"content": 3, "call_id": "call00001"}}[/TOOL_RESULTS]')
    answer = tokenizer(f"{space}It is 3.</s>", add_special_tokens=False)["input_ids"]
    renderer.add_turn(trajectory, answer, MistralFormat().parse(tokenizer.decode(answer)).message())
    assert tokenizer.decode(trajectory.ids) == renderer.render(trajectory.messages, add_generation_prompt=True)
    # a new user message moves [AVAILABLE_TOOLS] before it: the earlier conversation renders otherwise
    rewrite = renderer.add_messages(trajectory, [{"role": "user", "content": "And 2+2?"}])
    assert rewrite.rewrites_history and "[AVAILABLE_TOOLS]" in rewrite.reason


@pytest.mark.parametrize("tokenizer_fixture, space", MISTRAL_TEMPLATES)
def test_a_malformed_mistral_call_is_answered_without_the_template_raising(tokenizer_fixture, space, request,
                                                                            arithmetic):
    tokenizer, runner = request.getfixturevalue(tokenizer_fixture), ToolRunner([arithmetic["add"]])
    renderer = ChatRenderer(tokenizer, runner.schemas)
    trajectory = renderer.start([{"role": "user", "content": "What is 1+2?"}])
    text = f'[TOOL_CALLS]{space}[{{"name": "add", "arguments": {{"a": 1, "b": 2}}}}]'
    turn = MistralFormat().parse(text + "</s>")
    renderer.add_turn(trajectory, tokenizer(text + "</s>", add_special_tokens=False)["input_ids"], turn.message())
    tool_messages = asyncio.run(runner.answer(turn))
    assert tool_messages[0]["tool_call_id"] == "invalid00" and tool_messages[0]["content"].startswith("Error: malformed")
    # a turn without tool_calls renders as its text: as sampled on the tekken template; v0.3's puts a space
    # before it, which is reported, and the next row renders the whole conversation
    extension = renderer.add_messages(trajectory, tool_messages)
    assert extension.rewrites_history == bool(space)
    if space:
        assert "[/INST] [TOOL_CALLS]" in extension.reason
    whole = renderer.start(trajectory.messages + (tool_messages if space else []))
    assert whole.text.endswith(f"[/INST]{space}{text}</s>[TOOL_RESULTS]{space}{{\"content\": "
                               f"{tool_messages[0]['content']}, \"call_id\": \"invalid00\"}}[/TOOL_RESULTS]")
