"""The episode loop (aligner_ext/agents/episodes.py) with scripted environments and a scripted policy on
a real chat template (Qwen2.5's, conftest.py): every turn continues the trajectory's own ids, only sampled
ids carry a loss, each limit ends an episode as documented, a hung or raising environment holds back
only its own episode, a UserError stops the run at once, and the seeds alone decide the trajectories."""

import asyncio
import gc
import random

import pytest

from aligner_ext.agents.environment import StepResult, register_environment
from aligner_ext.errors import UserError

from tests.unit.agents.scripted import CALL, Adder, ScriptedPolicy, calls_then_answers, draws, run


def test_every_turn_continues_the_trajectorys_own_ids_and_only_sampled_ids_carry_loss(qwen25_tokenizer):
    engine = ScriptedPolicy(qwen25_tokenizer, calls_then_answers)
    (outcome,), session = run(engine, qwen25_tokenizer, draws((12, 30)))
    assert outcome.end == "done" and outcome.counts["turns"] == 2 and outcome.counts["tool_calls"] == 1
    (row,) = outcome.rows
    (turn1, _, _), (turn2, _, _) = engine.calls
    assert row.ids[: len(turn1)] == turn1 and row.ids[: len(turn2)] == turn2  # prefixes, never a re-rendering
    tokenizer = qwen25_tokenizer
    # worked out from the template by hand: the answer's turn, the `\n` after <|im_end|>, the tool message
    call = CALL.format(a=12, b=30)
    observation = "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    response = tokenizer.decode(row.ids[len(turn1):], skip_special_tokens=False)
    assert response == call + "<|im_end|>" + "\n" + observation + "42<|im_end|>"
    roles = row.roles[len(turn1):]
    n_call = len(call) + 1 - (len("<tool_call>") - 1) - (len("</tool_call>") - 1)  # a token per character or tag
    n_obs = len(observation) - sum(len(tag) - 1 for tag in ("<|im_start|>", "<|im_end|>", "<|im_start|>",
                                                            "<tool_response>", "</tool_response>"))
    assert roles == ["sampled"] * n_call + ["template"] + ["observation"] * n_obs + ["sampled"] * 3
    assert row.logprobs[len(turn1):][:n_call] == [-(i + 1) / 100 for i in range(n_call)]
    assert set(row.logprobs[len(turn1) + n_call:len(turn1) + n_call + 1 + n_obs]) == {0.0}
    assert outcome.turn_rewards == 0.25 and outcome.score.score == 1.0
    assert session["turns"] == 2 and session["prefilled_tokens"] == len(turn1) + len(turn2)


def test_max_turns_ends_the_episode_and_its_last_observation_is_not_trained(qwen25_tokenizer):
    engine = ScriptedPolicy(qwen25_tokenizer, lambda text, seed: CALL.format(a=1, b=1))  # never answers
    (outcome,), _ = run(engine, qwen25_tokenizer, draws((1, 1)), max_turns=3)
    assert outcome.end == "max_turns" and outcome.counts["turns"] == 3
    (row,) = outcome.rows
    assert row.roles[-1] == "sampled"  # the third turn's tool result was never appended
    assert row.messages[-1]["role"] == "assistant"


def test_max_total_tokens_caps_each_turn_and_drops_an_observation_that_does_not_fit(qwen25_tokenizer):
    engine = ScriptedPolicy(qwen25_tokenizer, calls_then_answers)
    (outcome,), _ = run(engine, qwen25_tokenizer, draws((5, 6)), max_new_tokens=500)
    full = len(outcome.rows[0].ids)
    first_turn = len(engine.calls[0][0])
    engine.calls.clear()
    # room for the first prompt and turn, not for the tool message: the episode ends, the row unchanged
    call_length = len(qwen25_tokenizer(CALL.format(a=5, b=6), add_special_tokens=False)["input_ids"]) + 1  # + <|im_end|>
    (outcome,), _ = run(engine, qwen25_tokenizer, draws((5, 6)), max_new_tokens=500,
                        max_total_tokens=first_turn + call_length + 5)
    assert outcome.end == "max_total_tokens"
    assert engine.calls[0][1] == call_length + 5  # the turn's cap: what is left of the row
    assert len(outcome.rows[0].ids) == first_turn + call_length < full
    assert outcome.rows[0].roles[-1] == "sampled" and len(outcome.rows[0].text) > 0
    # a turn cut by the row's limit
    engine.calls.clear()
    (outcome,), _ = run(engine, qwen25_tokenizer, draws((5, 6)), max_new_tokens=500, max_total_tokens=first_turn + 10)
    assert outcome.end == "max_total_tokens" and outcome.last_finish == "length"
    assert len(outcome.rows[0].ids) == first_turn + 10


@pytest.mark.parametrize("side, kept", [("right", "0123"), ("left", "6789"), ("middle", "0189")])
def test_a_long_observation_is_cut_to_max_observation_tokens_and_counted(qwen25_tokenizer, side, kept):
    class Echo(Adder):
        async def step(self, message, state):
            if state["log"]:
                return StepResult(done=True)
            state["log"].append(1)
            return StepResult([{"role": "user", "content": "0123456789"}])

    register_environment(f"test_echo_{side}")(Echo)
    engine = ScriptedPolicy(qwen25_tokenizer, lambda text, seed: "ok")
    (outcome,), _ = run(engine, qwen25_tokenizer, draws((1, 2)), environment=f"test_echo_{side}",
                        max_observation_tokens=4, observation_truncation=side)
    assert outcome.counts["truncated_observation_tokens"] == 6
    assert f"<|im_start|>user\n{kept}<|im_end|>" in qwen25_tokenizer.decode(outcome.rows[0].ids)


class KnowsItsRow(Adder):
    """Adder whose episode state names its row, so a test can make one row's environment misbehave."""

    async def reset(self, row):
        episode = await super().reset(row)
        episode.state["row"] = row.row_id
        return episode


def test_a_hung_environment_holds_back_only_its_own_episode(qwen25_tokenizer):
    """Row 0's tool answers only once the three other episodes have been scored: a loop that waited
    for every episode's tool at each turn would never finish."""
    others_done, finished = asyncio.Event(), []

    class HangsOnRowZero(KnowsItsRow):
        async def step(self, message, state):
            if state["row"] == "row0":
                await others_done.wait()
            return await super().step(message, state)

        async def score(self, state):
            if state["row"] != "row0":
                finished.append(state["row"])
                if len(finished) == 3:
                    others_done.set()
            return await super().score(state)

    register_environment("test_hangs")(HangsOnRowZero)
    outcomes, _ = run(ScriptedPolicy(qwen25_tokenizer, calls_then_answers), qwen25_tokenizer,
                      draws((1, 2), (3, 4), (5, 6), (7, 8)), environment="test_hangs")
    assert sorted(finished) == ["row1", "row2", "row3"]
    assert [o.end for o in outcomes] == ["done"] * 4 and all(o.score.score == 1.0 for o in outcomes)


def test_an_environment_that_raises_ends_its_episode_with_reward_0_and_the_run_goes_on(qwen25_tokenizer, caplog):
    class Raises(Adder):
        def step(self, message, state):  # a plain method: run in a worker thread
            if message.get("tool_calls") and "7" in message["tool_calls"][0]["function"]["arguments"].__repr__():
                raise RuntimeError("tool server down")
            return asyncio.run(Adder.step(self, message, state))

    register_environment("test_raises")(Raises)
    outcomes, _ = run(ScriptedPolicy(qwen25_tokenizer, calls_then_answers), qwen25_tokenizer,
                      draws((1, 2), (7, 8)), environment="test_raises")
    assert [o.end for o in outcomes] == ["done", "environment_error"]
    assert outcomes[1].score.score == 0.0 and outcomes[1].turn_rewards == 0.0 and len(outcomes[1].rows) == 1
    assert "tool server down" in caplog.text and "row1" in caplog.text


def test_the_seeds_decide_the_trajectories_whatever_order_environments_answer(qwen25_tokenizer):
    def sampled(text, seed):  # a reply drawn from the turn's seed alone
        if "<tool_response>" in text:
            return str(random.Random(seed).randint(0, 999))
        return CALL.format(a=random.Random(seed).randint(0, 9), b=1)

    order = []

    class Ordered(Adder):
        """Each episode's tool answers only after the episodes listed before it in `order` have answered."""

        async def reset(self, row):
            episode = await super().reset(row)
            episode.state["index"] = int(row.row_id[3:])
            return episode

        async def step(self, message, state):
            if message.get("tool_calls"):
                position = order.index(state["index"])
                await gates[position].wait()
                result = await super().step(message, state)
                if position + 1 < len(gates):
                    gates[position + 1].set()
                return result
            return await super().step(message, state)

    register_environment("test_ordered")(Ordered)
    results = []
    for order_now in ([0, 1, 2], [2, 0, 1]):
        order[:] = order_now
        gates = [asyncio.Event() for _ in order_now]
        gates[0].set()
        outcomes, _ = run(ScriptedPolicy(qwen25_tokenizer, sampled), qwen25_tokenizer, draws((1, 1), (1, 1), (1, 1)),
                          environment="test_ordered")
        results.append([o.rows[0].ids for o in outcomes])
    assert results[0] == results[1]
    assert len({tuple(ids) for ids in results[0]}) == 3  # distinct episodes: the seeds differ per episode


def test_a_history_rewriting_template_starts_a_new_row(qwen3_tokenizer):
    class Thinks(Adder):
        async def step(self, message, state):
            if state["log"]:
                return StepResult(done=True)
            state["log"].append(1)
            return StepResult([{"role": "user", "content": "again"}])

    register_environment("test_thinks")(Thinks)
    engine = ScriptedPolicy(qwen3_tokenizer, lambda text, seed: "<think>\nhm\n</think>\n\n3")
    (outcome,), _ = run(engine, qwen3_tokenizer, draws((1, 2)), environment="test_thinks")
    assert outcome.counts["history_rewrites"] == 1 and len(outcome.rows) == 2
    assert engine.calls[1][0] == outcome.rows[1].ids[: len(engine.calls[1][0])]
    assert "hm" not in qwen3_tokenizer.decode(outcome.rows[1].ids[: outcome.rows[1].prompt_length()])


def test_a_user_error_stops_the_run_without_waiting_for_the_other_episodes(qwen25_tokenizer, caplog):
    """Row 1's environment cannot run here (a UserError) while row 0's tool waits for an event no one
    sets: the run stops at the error, and asyncio reports no task's exception as never retrieved."""
    never = asyncio.Event()

    class CannotRunOnRowOne(KnowsItsRow):
        async def step(self, message, state):
            if state["row"] == "row0":
                await never.wait()
            raise UserError("agents.environment=test_user_error needs a sandbox this machine lacks")

    register_environment("test_user_error")(CannotRunOnRowOne)
    with pytest.raises(UserError, match="needs a sandbox"):
        run(ScriptedPolicy(qwen25_tokenizer, calls_then_answers), qwen25_tokenizer, draws((1, 2), (3, 4), (5, 6)),
            environment="test_user_error")
    gc.collect()  # asyncio reports an unretrieved task exception when the task is collected
    assert "never retrieved" not in caplog.text
