"""ToolEnvironment: the row's prompt and the tools' schemas at reset, every call attempt of a turn answered
(malformed ones and unknown tools included) and counted in the episode's own state, each answer quoting
its call's id where the format has ids (Mistral's, through the episode loop), and a turn without a call
ending the episode."""

import asyncio
from types import SimpleNamespace

import pytest

from aligner_ext.agents import tools
from aligner_ext.agents.environment import register_environment
from aligner_ext.agents.tool_environment import ToolEnvironment, ToolEpisode
from aligner_ext.data.types import PromptRow

from tests.unit.agents.conftest import add
from tests.unit.agents.scripted import ScriptedPolicy, draws, run


def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: The text.
    """
    return text.upper()


def halve(n: int) -> int:
    """Half of an even number.

    Args:
        n: An even number.
    """
    if n % 2:
        raise ValueError(f"{n} is odd")
    return n // 2


async def stall(n: int) -> int:
    """Never answer.

    Args:
        n: Ignored.
    """
    await asyncio.Event().wait()


class Shouting(ToolEnvironment):
    TOOLS = (shout, halve, stall)


ROW = PromptRow("t:0", [{"role": "system", "content": "Be loud."}, {"role": "user", "content": "Shout hi."}], "shouting")


def assistant(content="", calls=(), malformed=()):
    """An assistant message as the episode loop gives it: ParsedTurn.message() plus malformed attempts."""
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": name, "arguments": arguments}}
                                 for name, arguments in calls]
    if malformed:
        message["malformed_tool_calls"] = [{"text": text, "problem": problem} for text, problem in malformed]
    return message


def test_reset_gives_a_copy_of_the_prompt_the_schemas_and_a_fresh_state():
    env = Shouting()
    first, second = asyncio.run(env.reset(ROW)), asyncio.run(env.reset(ROW))
    assert first.messages == ROW.messages and [tool["function"]["name"] for tool in first.tools] == [
        "shout", "halve", "stall"]
    first.messages[1]["content"] = "changed"  # the loop extends its episode's conversation, never the row
    first.messages.append({"role": "assistant", "content": "HI"})
    assert ROW.messages[1]["content"] == "Shout hi." and len(ROW.messages) == 2
    assert first.state == ToolEpisode(ROW) and first.state is not second.state


def test_every_call_attempt_is_answered_in_order_and_counted(monkeypatch):
    ticks = iter([0.0, 1.0, 1.5, 2.25])  # the two calls that run start (concurrently), then end, in either order
    monkeypatch.setattr(tools, "time", SimpleNamespace(monotonic=lambda: next(ticks)))
    env = Shouting()
    state = asyncio.run(env.reset(ROW)).state
    message = assistant("Let me try.", calls=[("shout", {"text": "hi"}), ("halve", {"n": 3}), ("mul", {"a": 1})],
                        malformed=[('<tool_call>{"name": "shout"', "the <tool_call> is never closed with </tool_call>")])
    result = asyncio.run(env.step(message, state))
    assert result.messages == [
        {"role": "tool", "name": "shout", "content": "HI"},
        {"role": "tool", "name": "halve", "content": "Error: halve raised ValueError: 3 is odd"},
        {"role": "tool", "name": "mul", "content": "Error: unknown tool 'mul'; the tools are halve, shout, stall"},
        {"role": "tool", "name": "", "content": "Error: malformed tool call: the <tool_call> is never closed with "
                                                "</tool_call>"}]
    assert (result.done, result.reward) == (False, None)
    assert result.metrics == {"tool_errors": 3, "tool_errors_exception": 1, "tool_errors_unknown_tool": 1,
                              "tool_errors_malformed": 1, "tool_seconds": 2.75}  # ends 1.5 + 2.25 minus starts 0.0 + 1.0; 2 calls never ran
    assert state.answer == "Let me try."


def test_a_turn_of_malformed_calls_alone_is_answered_not_final():
    env = Shouting()
    state = asyncio.run(env.reset(ROW)).state
    result = asyncio.run(env.step(assistant("<tool_call>{", malformed=[("<tool_call>{", "not valid JSON")]), state))
    assert result.messages == [{"role": "tool", "name": "", "content": "Error: malformed tool call: not valid JSON"}]
    assert not result.done and result.metrics == {"tool_errors": 1, "tool_errors_malformed": 1}


def test_mistral_ids_come_back_on_each_answer():
    """Mistral's template needs every tool message to quote its call's id, a malformed attempt's included."""
    env = Shouting()
    state = asyncio.run(env.reset(ROW)).state
    message = {"role": "assistant", "content": "",
               "tool_calls": [{"type": "function", "id": "call00001",
                               "function": {"name": "shout", "arguments": {"text": "hi"}}}],
               "malformed_tool_calls": [{"text": '{"name": "shout"}', "problem": "no arguments", "id": "invalid01"}]}
    result = asyncio.run(env.step(message, state))
    assert result.messages == [
        {"role": "tool", "name": "shout", "content": "HI", "tool_call_id": "call00001"},
        {"role": "tool", "name": "", "content": "Error: malformed tool call: no arguments", "tool_call_id": "invalid01"}]


@register_environment("test_mistral_adder")
class MistralAdder(ToolEnvironment):
    TOOLS = (add,)


def test_a_mistral_episode_answers_each_attempt_under_its_id(mistral_tokenizer):
    """On Mistral v0.3's template, through the episode loop: a turn with a call and an attempt without an id
    is answered (the attempt under its stand-in id), the template renders both answers without raising,
    and the call's text re-rendered without the attempt starts a new training row."""
    def reply(text, seed):
        if "[TOOL_RESULTS]" not in text:
            return ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, '
                    '{"name": "add", "arguments": {"a": 1, "b": 2}, "id": "call00001"}]')
        return " It is 3."

    engine = ScriptedPolicy(mistral_tokenizer, reply, eos="</s>")
    (outcome,), _ = run(engine, mistral_tokenizer, draws((1, 2), source="adder"), environment="test_mistral_adder",
                        max_new_tokens=200)
    assert outcome.end == "done" and outcome.counts["tool_calls"] == 2 and outcome.counts["malformed_calls"] == 1
    assert outcome.counts["history_rewrites"] == 1 and len(outcome.rows) == 2
    assert outcome.rows[1].text.endswith(
        '[TOOL_RESULTS] {"content": 3, "call_id": "call00001"}[/TOOL_RESULTS][TOOL_RESULTS] {"content": Error: '
        'malformed tool call: the tool call\'s "id" must be 9 letters or digits, "call_id": "invalid00"}'
        '[/TOOL_RESULTS] It is 3.</s>')


def test_a_turn_without_a_call_ends_the_episode_and_the_registry_scores_it():
    env = Shouting()
    state = asyncio.run(env.reset(ROW)).state
    called = asyncio.run(env.step(assistant(calls=[("shout", {"text": "hi"})]), state))
    result = asyncio.run(env.step(assistant("HI!"), state))
    assert (result.messages, result.done) == ([], True)
    assert state.answer == "HI!" and "tool_errors" not in called.metrics and result.metrics == {}
    assert asyncio.run(env.score(state)) is None


def test_concurrent_episodes_count_apart_and_a_stalled_tool_times_out():
    env = Shouting(timeout_s=1.0)  # stall never answers; the plain tools have a second to run in their threads

    async def two_episodes():
        first, second = await env.reset(ROW), await env.reset(ROW)
        return await asyncio.gather(
            env.step(assistant(calls=[("stall", {"n": 1})]), first.state),
            env.step(assistant(calls=[("shout", {"text": "a"}), ("halve", {"n": "2"})]), second.state))

    stalled, other = asyncio.run(two_episodes())
    assert stalled.messages == [{"role": "tool", "name": "stall", "content": "Error: stall did not finish within 1 s"}]
    assert stalled.metrics["tool_errors_timeout"] == 1 and "tool_errors_bad_arguments" not in stalled.metrics
    assert other.metrics["tool_errors_bad_arguments"] == 1 and "tool_errors_timeout" not in other.metrics


def test_an_environment_without_tools_is_refused():
    class Empty(ToolEnvironment):
        pass

    with pytest.raises(TypeError, match="Empty lists no TOOLS"):
        Empty()
