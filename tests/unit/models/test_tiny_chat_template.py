"""The embedded model's chat template: a conversation without tools renders byte for byte as the plain
ChatML template it had before tools (the demo's numbers and warm-up cache depend on it); with tools it
names them in one system turn and writes calls in the hermes syntax, so a calculator episode played by
the episode loop is token-exact, with no history rewrite. Expected texts are written out by hand."""

import pytest

from aligner_ext.agents.calculator import calculator
from aligner_ext.agents.tool_calls import tool_call_format
from aligner_ext.agents.tools import tool_schema
from aligner_ext.data.types import PromptDraw, PromptRow
from aligner_ext.models.tiny import build_char_tokenizer

from tests.unit.agents.scripted import ScriptedPolicy, run

# the template before tools, as it was
PLAIN_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "12+7="}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+7=\nok?"}],
    [{"role": "user", "content": "12+7="}, {"role": "assistant", "content": "12+7=19\n\\boxed{19}"},
     {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "Guess."}, {"role": "assistant", "content": "50"}, {"role": "tool", "content": "lower"}],
]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123456+654321"}}\n</tool_call>'
TOOLS_LINE = "<|im_start|>system\nTools: calculator(expression)<|im_end|>\n"
QUESTION = "Compute 123456+654321 with the calculator; answer in \\boxed{}."


def tokens(text):
    """Tokens of `text`: one per character, <|im_start|> (12 characters) and <|im_end|> (10) one each."""
    return len(text) - 11 * text.count("<|im_start|>") - 9 * text.count("<|im_end|>")


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_a_conversation_without_tools_renders_as_plain_chatml(tokenizer, messages, generation_prompt):
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    tokenizer_before = build_char_tokenizer()
    tokenizer_before.chat_template = PLAIN_CHATML
    assert rendered == tokenizer_before.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                                            tokenize=False)


def test_tools_are_named_in_one_system_turn_and_calls_are_written_in_hermes_syntax(tokenizer):
    assert tool_call_format(tokenizer).name == "hermes"
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "123456+654321"}}}
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": "777777"},
                {"role": "assistant", "content": "Two:", "tool_calls": [call, call]}]
    rendered = tokenizer.apply_chat_template(messages, tools=[tool_schema(calculator)], tokenize=False)
    assert rendered == (TOOLS_LINE + f"<|im_start|>user\n{QUESTION}<|im_end|>\n"
                        f"<|im_start|>assistant\n{CALL}<|im_end|>\n"
                        "<|im_start|>tool\n777777<|im_end|>\n"
                        f"<|im_start|>assistant\nTwo:\n{CALL}\n{CALL}<|im_end|>\n")
    # the calls are characters: no token of the vocabulary is a tag
    assert len(tokenizer(CALL, add_special_tokens=False)["input_ids"]) == len(CALL)


def test_a_calculator_episode_is_token_exact_on_the_tiny_template(tokenizer):
    """The episode loop with the built-in `calculator` environment and a policy that calls it, then
    answers: every id of the row is the whole conversation's rendering, each id in its role."""

    def call_then_answer(text, seed):
        if "<|im_start|>tool\n" not in text:
            return CALL
        return "\\boxed{" + text.split("<|im_start|>tool\n")[-1].split("<|im_end|>")[0] + "}"

    draw = PromptDraw(PromptRow("row0", [{"role": "user", "content": QUESTION}], "calculator_arithmetic",
                                ground_truth="777777"), [], 0)
    (outcome,), _ = run(ScriptedPolicy(tokenizer, call_then_answer), tokenizer, [draw], environment="calculator",
                        max_new_tokens=128, max_total_tokens=512)
    assert outcome.end == "done" and outcome.score.score == 1.0 and outcome.counts["history_rewrites"] == 0
    (row,) = outcome.rows
    prompt = TOOLS_LINE + f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    observation = "<|im_start|>tool\n777777<|im_end|>\n<|im_start|>assistant\n"
    answer = "\\boxed{777777}<|im_end|>"
    assert tokenizer.decode(row.ids) == prompt + CALL + "<|im_end|>" + "\n" + observation + answer
    assert row.roles == (["prompt"] * tokens(prompt) + ["sampled"] * tokens(CALL + "<|im_end|>") + ["template"]
                         + ["observation"] * tokens(observation) + ["sampled"] * tokens(answer))
    assert row.ids == tokenizer(prompt + CALL + "<|im_end|>\n" + observation + answer, add_special_tokens=False)["input_ids"]
