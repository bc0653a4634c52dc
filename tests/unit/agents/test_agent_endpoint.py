"""Agent code as the rollout (aligner_ext/agents/endpoint.py, agent_functions.py): agent functions written
with the `openai` SDK against the session endpoint, on a scripted policy and Qwen2.5's chat template
(conftest.py). A session's row is the ids the engine sampled plus the new messages as the template's
suffix, never a re-encoding; an edited history starts a counted new row; an agent that raises or hangs is
a counted failure with one logged line; the endpoint's errors are OpenAI's shape."""

import asyncio
import json
import logging

import openai
import pytest

from aligner_ext.agents.agent_functions import AgentFunctionRunner, agent_function, serving
from aligner_ext.agents.endpoint import SessionEndpoint
from aligner_ext.agents.sessions import GenerateEachTurn
from aligner_ext.agents.settings import AgentsConfig, EpisodeLimits
from aligner_ext.agents.tools import tool_schema
from aligner_ext.data.types import PromptDraw, PromptRow
from aligner_ext.config import load_config
from aligner_ext.errors import ConfigError
from aligner_ext.experience.agent_episodes import AgentEpisodes
from aligner_ext.generation.base import SamplingParams

from tests.unit.agents.conftest import add
from tests.unit.agents.scripted import ScriptedPolicy, calls_then_answers

pytestmark = pytest.mark.timeout(120)

TOOLS = [tool_schema(add)]
ANSWERS = {}  # row id -> the chat completions the agent received, for the tests to read


class SpelledPolicy(ScriptedPolicy):
    """ScriptedPolicy that samples its reply one character per id, tags included: `<tool_call>` comes out
    as 11 character ids where encoding the text gives the tag's one id."""

    def generate(self, prompts, params):
        outputs = super().generate(prompts, params)
        for output in outputs:
            text = self.tokenizer.decode(output.token_ids[:-1], skip_special_tokens=False)
            output.token_ids[:-1] = self.tokenizer.convert_tokens_to_ids(list(text))
            output.logprobs = [-(i + 1) / 100 for i in range(len(output.token_ids))]
        return outputs


async def tool_agent(client, row):
    """An agent loop as written for the OpenAI API: call, run the tool calls, answer."""
    messages = list(row.messages)
    first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    message = first.choices[0].message
    messages.append(message)  # the SDK's own object, as agent code appends it
    for call in message.tool_calls:
        result = add(**json.loads(call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    final = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    ANSWERS[row.row_id] = (first, final)
    return float(final.choices[0].message.content == str(row.ground_truth))


async def editing_agent(client, row):
    """Asks once, then asks again with the question changed under the same call and result."""
    first = await client.chat.completions.create(model="policy", messages=row.messages, tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    edited = [{"role": "user", "content": "12+31?"}, first.choices[0].message,
              {"role": "tool", "tool_call_id": call.id, "content": "43"}]
    await client.chat.completions.create(model="policy", messages=edited, tools=TOOLS)


async def failing_agent(client, row):
    """By row: answers once and raises, hangs before asking, or plays the tool loop."""
    if row.row_id == "raises":
        await client.chat.completions.create(model="policy", messages=row.messages, tools=TOOLS)
        raise RuntimeError("the agent's own bug")
    if row.row_id == "hangs":
        await asyncio.Event().wait()
    return await tool_agent(client, row)


def draw(row_id, content="12+30?", answer=42):
    return PromptDraw(PromptRow(row_id, [{"role": "user", "content": content}], "test", ground_truth=answer), [], 0)


def play(engine, tokenizer, agent, draws, **limits):
    cfg = AgentsConfig(agent=f"{__name__}:{agent}", limits=EpisodeLimits(**limits))
    return AgentFunctionRunner(engine, tokenizer, cfg).run(draws, 1, SamplingParams(max_new_tokens=64, seed=7,
                                                                                    return_logprobs=True))


def test_an_openai_sdk_agent_with_a_tool_is_recorded_as_sampled_plus_the_templates_suffix(qwen25_tokenizer):
    tok = qwen25_tokenizer
    engine = SpelledPolicy(tok, calls_then_answers)
    (outcome,), stats = play(engine, tok, "tool_agent", [draw("sum")])
    first, final = ANSWERS["sum"]
    assert outcome.end == "done" and outcome.score.score == 1.0 and outcome.counts["turns"] == 2
    # the answer in OpenAI's shape: arguments a JSON string, an id, the sampled ids beside them
    call = first.choices[0].message.tool_calls[0]
    assert (call.id, call.function.name, call.function.arguments) == ("call_0_0", "add", '{"a": 12, "b": 30}')
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
    assert final.choices[0].message.content == "42" and final.choices[0].finish_reason == "stop"
    (row,) = outcome.rows
    (turn1, _, seed1), (turn2, _, seed2) = engine.calls
    # turn 1 continued the first messages as the template renders them; turn 2 continued the row itself
    assert turn1 == tok.apply_chat_template([{"role": "user", "content": "12+30?"}], tools=TOOLS,
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
    assert first.model_extra["prompt_token_ids"] == turn1 and final.model_extra["prompt_token_ids"] == turn2
    sampled1, sampled2 = first.choices[0].model_extra["token_ids"], final.choices[0].model_extra["token_ids"]
    assert row.ids == turn2 + sampled2 and turn2[: len(turn1) + len(sampled1)] == turn1 + sampled1
    # the call's ids as sampled, one per character: encoding its text again would give the tag's own id
    tag = tok.convert_tokens_to_ids("<tool_call>")
    assert tag not in sampled1 and tag in tok(tok.decode(sampled1), add_special_tokens=False)["input_ids"]
    # what lies between the turns is the template's: `\n` after <|im_end|>, then the tool message's block
    between = tok.decode(turn2[len(turn1) + len(sampled1):], skip_special_tokens=False)
    assert between == "\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    conversation = [{"role": "user", "content": "12+30?"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 30}}}]},
                    {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"}]
    assert tok.decode(row.ids, skip_special_tokens=False) + "\n" == tok.apply_chat_template(
        conversation, tools=TOOLS, tokenize=False)
    sampled = [position for position, role in enumerate(row.roles) if role == "sampled"]
    assert sampled == [*range(len(turn1), len(turn1) + len(sampled1)), *range(len(turn2), len(row.ids))]
    assert [row.logprobs[p] for p in sampled] == [-(i + 1) / 100 for i in range(len(sampled1))] + [
        -(i + 1) / 100 for i in range(len(sampled2))]
    assert stats["turns"] == 2 and outcome.counts["edited_history"] == 0


def test_an_agent_that_edits_history_gets_a_new_row_counted(qwen25_tokenizer):
    tok = qwen25_tokenizer
    engine = ScriptedPolicy(tok, calls_then_answers)
    (outcome,), _ = play(engine, tok, "editing_agent", [draw("edits")])
    assert outcome.counts["edited_history"] == 1 and len(outcome.rows) == 2
    first, second = outcome.rows
    (turn1, _, _), (turn2, _, _) = engine.calls
    assert first.ids[: len(turn1)] == turn1 and second.ids[: len(turn2)] == turn2
    # the new row's prompt is the edited conversation rendered whole (arguments as the template takes them)
    edited = [{"role": "user", "content": "12+31?"},
              {"role": "assistant", "content": "", "tool_calls": [
                  {"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 30}}}]},
              {"role": "tool", "content": "43"}]
    assert turn2 == tok.apply_chat_template(edited, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
    assert second.roles[: len(turn2)] == ["prompt"] * len(turn2)


def test_an_agent_that_raises_or_hangs_is_a_counted_failure_with_one_logged_line(qwen25_tokenizer, caplog):
    tok = qwen25_tokenizer
    engine = ScriptedPolicy(tok, calls_then_answers)
    with caplog.at_level(logging.WARNING, logger="aligner_ext.agents.agent_functions"):
        outcomes, _ = play(engine, tok, "failing_agent", [draw("raises"), draw("hangs"), draw("plays")],
                           max_episode_seconds=3)
    raised, hung, played = outcomes
    assert (raised.end, hung.end, played.end) == ("environment_error", "max_episode_seconds", "done")
    assert raised.score.score == hung.score.score == 0.0 and played.score.score == 1.0
    assert len(raised.rows) == 1 and raised.counts["turns"] == 1 and hung.rows == []
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2
    assert "row raises: the agent function raised RuntimeError: the agent's own bug" in lines[0]
    assert "row hangs: the agent function did not finish within agents.limits.max_episode_seconds=3" in lines[1]


def test_the_endpoints_errors_are_openai_shaped(qwen25_tokenizer):
    tok = qwen25_tokenizer
    engine = ScriptedPolicy(tok, calls_then_answers)
    params = SamplingParams(max_new_tokens=16, seed=0)

    async def errors():
        endpoint = SessionEndpoint(tok, lambda: GenerateEachTurn(engine, params), EpisodeLimits(max_total_tokens=60),
                                   "policy", 16)
        endpoint.open("s", 0)
        found = {}
        async with serving(endpoint) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/sessions/s/v1", api_key="none", max_retries=0)
            stranger = openai.AsyncOpenAI(base_url=f"{url}/sessions/nobody/v1", api_key="none", max_retries=0)
            asks = {"unknown_model": (client, {"model": "gpt-4o", "messages": [{"role": "user", "content": "1+2?"}]}),
                    "bad_role": (client, {"model": "policy", "messages": [{"role": "wizard", "content": "hi"}]}),
                    "no_messages": (client, {"model": "policy", "messages": []}),
                    "two_samples": (client, {"model": "policy", "n": 2, "messages": [{"role": "user", "content": "1"}]}),
                    "too_long": (client, {"model": "policy", "messages": [{"role": "user", "content": "9" * 80}]}),
                    "unknown_session": (stranger, {"model": "policy", "messages": [{"role": "user", "content": "1"}]})}
            for name, (asker, body) in asks.items():
                with pytest.raises(openai.APIStatusError) as caught:
                    await asker.chat.completions.create(**body)
                found[name] = (caught.value.status_code, caught.value.body)
            for asker in (client, stranger):
                await asker.close()
        await endpoint.stop()
        return found

    found = asyncio.run(errors())
    for status, body in found.values():
        assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    assert found["unknown_model"][0] == 404 and found["unknown_model"][1]["code"] == "model_not_found"
    assert found["bad_role"][0] == 400 and "messages[0] needs a role" in found["bad_role"][1]["message"]
    assert found["no_messages"][0] == 400 and found["no_messages"][1]["message"].startswith("invalid request body")
    assert found["two_samples"][0] == 400 and found["two_samples"][1]["param"] == "n"
    assert found["too_long"][0] == 400 and found["too_long"][1]["code"] == "context_length_exceeded"
    assert found["unknown_session"][0] == 404 and found["unknown_session"][1]["code"] == "session_not_found"


def test_what_is_not_an_async_agent_function_is_refused_in_one_line_naming_the_setting():
    with pytest.raises(ConfigError, match=rf"^agents.agent={__name__}:draw is <function draw .*>; it must be an "
                                          r"`async def agent\(client, row\)`"):
        agent_function(f"{__name__}:draw")
    with pytest.raises(ConfigError, match="^agents.agent=no_such_module:agent: cannot import module 'no_such_module'"):
        agent_function("no_such_module:agent")


def test_an_agent_function_beside_a_named_environment_is_refused_at_load():
    rows = [draw("sum").row]
    agent = ["algorithm.experience_maker=agent_episodes", f"agents.agent={__name__}:tool_agent",
             "agents.limits.max_total_tokens=256"]
    cfg = load_config("base", agent)
    assert AgentEpisodes.rows_scored_by_rewards(cfg, rows) == rows  # the registry may score any of them
    with pytest.raises(ValueError, match=rf"agents.agent={__name__}:tool_agent and agents.environment=test_adder "
                                          "both say how episodes run: set one of them"):
        load_config("base", agent + ["agents.environment=test_adder"])


def test_routing_replay_beside_an_agent_function_is_refused_at_load():
    with pytest.raises(ValueError, match=rf"^policy.routing_replay=true with agents.agent={__name__}:tool_agent: the "
                                         "agent endpoint does not record the experts"):
        load_config("base", ["algorithm.experience_maker=agent_episodes", f"agents.agent={__name__}:tool_agent",
                             "policy.routing_replay=true"])
