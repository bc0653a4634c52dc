"""Tool calls read from sampled text in each family's syntax, the format chosen from the chat template,
and malformed calls kept (in order, with the problem) instead of raised."""

import pytest

from aligner_ext.agents.tool_calls import HermesFormat, Llama3JsonFormat, MalformedCall, ToolCall, tool_call_format
from aligner_ext.errors import ConfigError
from aligner_ext.models.tiny import build_char_tokenizer

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
    with pytest.raises(ConfigError, match="defines no tool-call format this library reads"):
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
