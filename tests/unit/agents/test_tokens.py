"""Token-exact trajectories on real chat templates (tests/fixtures/chat_templates/): sampled ids kept
as sampled, observations the template's suffix encoded once, Qwen's `\\n` after `<|im_end|>` a
template token, two tool messages rendered as the whole conversation renders them, and history
rewrites (Qwen3's dropped thinking, a turn that re-renders otherwise) reported instead of merged.
The expected renderings are written out by hand from the templates."""

import asyncio

import pytest

from aligner_ext.agents.tokens import ChatRenderer
from aligner_ext.agents.tool_calls import tool_call_format
from aligner_ext.agents.tools import ToolRunner

ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
MUL_CALL = '<tool_call>\n{"name": "mul", "arguments": {"a": 3, "b": 4}}\n</tool_call>'


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def model_turn(renderer, trajectory, sampled_ids):
    """What the rollout does with a sampled turn: parse its calls, append it, run the calls."""
    tokenizer = renderer.tokenizer
    parsed = tool_call_format(tokenizer).parse(tokenizer.decode(sampled_ids, skip_special_tokens=False))
    renderer.add_turn(trajectory, sampled_ids, parsed.message())
    return parsed


def test_a_three_turn_qwen25_episode_is_token_exact(qwen25_tokenizer, arithmetic):
    tokenizer, runner = qwen25_tokenizer, ToolRunner([arithmetic["add"], arithmetic["mul"]])
    newline, im_end = tokenizer.convert_tokens_to_ids("\n"), tokenizer.convert_tokens_to_ids("<|im_end|>")
    renderer = ChatRenderer(tokenizer, runner.schemas)
    trajectory = renderer.start([{"role": "user", "content": "What are 1+2 and 3*4?"}])
    prompt = list(trajectory.ids)

    # turn 1: two calls. The sampler spelled the first <tool_call> in characters: those ids are kept,
    # though encoding the turn's text again would give the single <tool_call> token instead.
    text1 = f"{ADD_CALL}\n{MUL_CALL}<|im_end|>"
    sampled1 = [tokenizer.convert_tokens_to_ids(char) for char in "<tool_call>"] + encode(tokenizer, text1[11:])
    assert sampled1 != encode(tokenizer, text1)
    parsed = model_turn(renderer, trajectory, sampled1)
    tool_messages = asyncio.run(runner.answer(parsed))
    assert [message["content"] for message in tool_messages] == ["3", "12"]
    first = renderer.add_messages(trajectory, tool_messages)
    assert not first.rewrites_history and first.template_ids == [newline]
    assert tokenizer.decode(first.observation_ids) == (  # both tool messages in one user block
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n12\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")

    # turn 2: an answer, and the user's feedback
    sampled2 = encode(tokenizer, "They are 3 and 12.<|im_end|>")
    model_turn(renderer, trajectory, sampled2)
    second = renderer.add_messages(trajectory, [{"role": "user", "content": "Sure?"}])
    assert not second.rewrites_history and second.template_ids == [newline]
    assert tokenizer.decode(second.observation_ids) == "<|im_start|>user\nSure?<|im_end|>\n<|im_start|>assistant\n"

    # turn 3: the last answer
    sampled3 = encode(tokenizer, "Yes.<|im_end|>")
    model_turn(renderer, trajectory, sampled3)

    assert trajectory.ids == (prompt + sampled1 + [newline] + first.observation_ids + sampled2 + [newline]
                              + second.observation_ids + sampled3)
    assert trajectory.roles == (["prompt"] * len(prompt) + ["sampled"] * len(sampled1) + ["template"]
                                + ["observation"] * len(first.observation_ids) + ["sampled"] * len(sampled2)
                                + ["template"] + ["observation"] * len(second.observation_ids)
                                + ["sampled"] * len(sampled3))
    boundary = len(prompt) + len(sampled1)  # the sampled turn ends at <|im_end|>; the template's "\n" follows
    assert (trajectory.ids[boundary - 1], trajectory.roles[boundary - 1]) == (im_end, "sampled")
    assert (trajectory.ids[boundary], trajectory.roles[boundary]) == (newline, "template")
    assert sum(trajectory.sampled_mask()) == len(sampled1) + len(sampled2) + len(sampled3)
    whole = tokenizer.apply_chat_template(trajectory.messages, tools=runner.schemas, tokenize=False)
    assert tokenizer.decode(trajectory.ids) + "\n" == whole  # the template closes the last turn with "\n" too
    assert trajectory.messages[1]["tool_calls"][1]["function"] == {"name": "mul", "arguments": {"a": 3, "b": 4}}


def test_llama31_has_no_boundary_token_and_renders_tool_output_as_json(llama31_tokenizer, arithmetic):
    tokenizer = llama31_tokenizer
    renderer = ChatRenderer(tokenizer, ToolRunner([arithmetic["add"]]).schemas)
    trajectory = renderer.start([{"role": "user", "content": "What is 1+2?"}])
    model_turn(renderer, trajectory, encode(tokenizer, '{"name": "add", "parameters": {"a": 1, "b": 2}}<|eot_id|>'))
    assert trajectory.messages[-1]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 1, "b": 2}}
    extension = renderer.add_messages(trajectory, [{"role": "tool", "content": "3"}])
    assert not extension.rewrites_history and extension.template_ids == []
    # Llama 3.1's template writes a string tool result through tojson: "3" with its quotes
    assert tokenizer.decode(extension.observation_ids) == (
        '<|start_header_id|>ipython<|end_header_id|>\n\n"3"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n')
    assert tokenizer.decode(trajectory.ids) == renderer.render(trajectory.messages, add_generation_prompt=True)


def test_qwen3_dropping_earlier_thinking_is_reported_and_a_new_row_starts(qwen3_tokenizer, arithmetic):
    tokenizer = qwen3_tokenizer
    newline = tokenizer.convert_tokens_to_ids("\n")
    renderer = ChatRenderer(tokenizer, ToolRunner([arithmetic["add"]]).schemas)
    trajectory = renderer.start([{"role": "user", "content": "What is 1+2?"}])
    model_turn(renderer, trajectory, encode(tokenizer, f"<think>\nNeed add.\n</think>\n\n{ADD_CALL}<|im_end|>"))
    # tool results come after the latest user message: Qwen3 keeps this turn's thinking, the row continues
    extension = renderer.add_messages(trajectory, [{"role": "tool", "content": "3"}])
    assert not extension.rewrites_history and extension.template_ids == [newline]
    assert tokenizer.decode(extension.observation_ids) == (
        "<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    model_turn(renderer, trajectory, encode(tokenizer, "<think>\nDone.\n</think>\n\nIt is 3.<|im_end|>"))
    ids_before, text_before = list(trajectory.ids), trajectory.text

    # a new user message: Qwen3 now renders both earlier turns without their thinking
    feedback = [{"role": "user", "content": "Now add 4."}]
    rewrite = renderer.add_messages(trajectory, feedback)
    assert rewrite.rewrites_history and rewrite.template_ids == rewrite.observation_ids == []
    assert "change how the template renders the conversation before them" in rewrite.reason
    assert "<think>\\nNeed add.\\n</think>" in rewrite.reason  # where the renderings part: the first turn's thinking
    assert (trajectory.ids, trajectory.text) == (ids_before, text_before)  # nothing merged

    next_row = renderer.start(trajectory.messages + feedback)
    assert set(next_row.roles) == {"prompt"} and "Need add." not in next_row.text
    assert next_row.text.endswith("<|im_start|>assistant\nIt is 3.<|im_end|>\n<|im_start|>user\nNow add 4.<|im_end|>\n"
                                  "<|im_start|>assistant\n")


def test_a_turn_stopped_at_the_call_end_gets_the_whole_turn_closing_as_template(qwen25_tokenizer, arithmetic):
    """Generation stopped at the stop string </tool_call>: the template's <|im_end|> and "\n" were not sampled."""
    tokenizer = qwen25_tokenizer
    renderer = ChatRenderer(tokenizer, ToolRunner([arithmetic["add"]]).schemas)
    trajectory = renderer.start([{"role": "user", "content": "What is 1+2?"}])
    model_turn(renderer, trajectory, encode(tokenizer, ADD_CALL))
    extension = renderer.add_messages(trajectory, [{"role": "tool", "content": "3"}])
    assert extension.template_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("\n")]
    assert trajectory.roles[-len(extension.observation_ids) - 3:-len(extension.observation_ids)] == [
        "sampled", "template", "template"]


def test_a_turn_that_re_renders_otherwise_is_reported(qwen25_tokenizer, arithmetic):
    """The model spaced its call's JSON otherwise than the template's tojson writes it."""
    tokenizer = qwen25_tokenizer
    renderer = ChatRenderer(tokenizer, ToolRunner([arithmetic["add"]]).schemas)
    trajectory = renderer.start([{"role": "user", "content": "What is 1+2?"}])
    model_turn(renderer, trajectory, encode(tokenizer, '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n'
                                                       '</tool_call><|im_end|>'))
    length = len(trajectory.ids)
    result = renderer.add_messages(trajectory, [{"role": "tool", "content": "3"}])
    assert result.rewrites_history and len(trajectory.ids) == length
    assert result.reason.startswith("the conversation re-renders differently from the trajectory's text: at character")
    assert '{"name":"add","arguments":{"a":1' in result.reason and '{"name": "add", "arguments": {"a": 1' in result.reason


def test_messages_follow_a_model_turn(qwen25_tokenizer):
    renderer = ChatRenderer(qwen25_tokenizer)
    trajectory = renderer.start([{"role": "user", "content": "Hi"}])
    with pytest.raises(ValueError, match="add_messages follows a model turn"):
        renderer.add_messages(trajectory, [{"role": "user", "content": "Hello?"}])
    with pytest.raises(ValueError, match="at least one sampled id"):
        renderer.add_turn(trajectory, [], {"role": "assistant", "content": ""})
