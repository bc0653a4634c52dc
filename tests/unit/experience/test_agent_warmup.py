"""The supervised warm-up of agent episodes (AgentEpisodes.warmup_examples, models/warmup.py): each
model turn of a row's gold transcript is a target after the episode's first messages, its tools and
the transcript before it, rendered as the episode renders it; a row without a transcript keeps its
gold solution. The expected examples are worked out by hand from the rows' questions."""

import re

import pytest

import aligner_ext.plugins  # noqa: F401 - registers the built-in environments
from aligner_ext.agents.calculator import calculator
from aligner_ext.agents.tokens import ChatRenderer
from aligner_ext.agents.tools import tool_schema
from aligner_ext.config import load_config
from aligner_ext.data.tasks import builtin_rows
from aligner_ext.data.templating import encode_prompt
from aligner_ext.data.types import PromptRow
from aligner_ext.experience.agent_episodes import AgentEpisodes
from aligner_ext.models.tiny import build_char_tokenizer
from aligner_ext.models.warmup import rendered_turn

AGENTS = ["algorithm.experience_maker=agent_episodes", "data.builtin_task=calculator_arithmetic",
          "agents.limits.max_total_tokens=384"]


@pytest.fixture(scope="module")
def cfg():
    return load_config("base", AGENTS)


def test_each_turn_of_a_calculator_row_is_a_target_after_the_turns_before_it(cfg):
    rows = builtin_rows("calculator_arithmetic", "train", 2, 0)
    examples = AgentEpisodes.warmup_examples(cfg, rows)
    assert len(examples) == 4  # two model turns per row: the call, the answer
    for row, (first, second) in zip(rows, [examples[0:2], examples[2:4]]):
        a, symbol, b = re.fullmatch(r"Compute (\d+)([+*])(\d+) with the calculator; answer in \\boxed\{\}\.",
                                    row.messages[0]["content"]).groups()
        result = str(int(a) + int(b) if symbol == "+" else int(a) * int(b))
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a}{symbol}{b}"}}}]}
        messages, target, tools = first
        assert messages == row.messages and target == call
        assert [tool["function"]["name"] for tool in tools] == ["calculator"]
        messages, target, tools = second
        assert messages == row.messages + [call, {"role": "tool", "name": "calculator", "content": result}]
        assert target == {"role": "assistant", "content": f"\\boxed{{{result}}}"}


def test_a_row_without_a_transcript_is_warmed_up_on_its_gold_solution(cfg):
    row = PromptRow("r", [{"role": "user", "content": "Compute 1+2 with the calculator; answer in \\boxed{}."}],
                    "calculator_arithmetic", "3", extra_info={"gold_solution": "\\boxed{3}"})
    assert AgentEpisodes.warmup_examples(cfg, [row]) == [(row.messages, "\\boxed{3}")]


def test_the_warmup_sees_the_episodes_prompt_and_learns_the_turn_the_template_writes(cfg):
    tokenizer = build_char_tokenizer()
    (row,) = builtin_rows("calculator_arithmetic", "train", 1, 0)
    (messages, call, tools), (after_call, answer, _) = AgentEpisodes.warmup_examples(cfg, [row])
    # the warm-up's prompt is the episode's first prompt, the calculator's tools line included
    episode_prompt = ChatRenderer(tokenizer, [tool_schema(calculator)]).start(row.messages).ids
    assert encode_prompt(tokenizer, messages, tools) == episode_prompt
    expression = call["tool_calls"][0]["function"]["arguments"]["expression"]
    written = f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
    assert tokenizer.decode(rendered_turn(tokenizer, messages, call, tools)) == written + "<|im_end|>"
    assert tokenizer.decode(rendered_turn(tokenizer, after_call, answer, tools)) == answer["content"] + "<|im_end|>"
