"""The environment interface: plain methods become awaitable and run off the event loop (so one slow
episode waits alone), async ones stay as written, and environments are found by name, by data_source
or by dotted path."""

import asyncio
import inspect
import threading

import pytest

from aligner_ext.agents import environment
from aligner_ext.agents.environment import Environment, Episode, StepResult, environment_class, register_environment
from aligner_ext.registry import Registry


class CountdownGame(Environment):
    """Plain methods: the episode ends after `row` turns; each turn answers with the turns left."""

    def reset(self, row):
        return Episode(messages=[{"role": "user", "content": "count"}], state={"left": row,
                                                                              "thread": threading.get_ident()})

    def step(self, assistant_message, state):
        state["left"] -= 1
        state["thread"] = threading.get_ident()
        return StepResult(messages=[{"role": "user", "content": str(state["left"])}], reward=0.5,
                          done=state["left"] == 0)


class AsyncEcho(Environment):
    async def reset(self, row):
        return Episode(messages=[{"role": "user", "content": row}])

    async def step(self, assistant_message, state):
        return StepResult(messages=[{"role": "user", "content": assistant_message["content"]}], done=True)

    async def score(self, state):
        return 1.0


def test_plain_methods_are_awaited_in_a_worker_thread():
    assert all(inspect.iscoroutinefunction(getattr(CountdownGame, name)) for name in ("reset", "step", "score"))
    env = CountdownGame()

    async def episode():
        first = await env.reset(2)
        steps = [await env.step({"role": "assistant", "content": "go"}, first.state) for _ in range(2)]
        return first, steps

    first, steps = asyncio.run(episode())
    assert first.state["thread"] != threading.get_ident() and first.messages[0]["content"] == "count"
    assert [(s.messages[0]["content"], s.reward, s.done) for s in steps] == [("1", 0.5, False), ("0", 0.5, True)]
    assert asyncio.run(env.score(first.state)) is None  # the default: the reward registry scores the transcript


def test_async_methods_stay_as_written():
    assert AsyncEcho.reset.__qualname__ == "AsyncEcho.reset"
    env = AsyncEcho()
    result = asyncio.run(env.step({"role": "assistant", "content": "hi"}, None))
    assert result.messages == [{"role": "user", "content": "hi"}] and result.done
    assert asyncio.run(env.score(None)) == 1.0


def test_a_blocking_plain_step_does_not_stall_other_episodes():
    """Episode A's step blocks until episode B's step has run: on the event loop's thread that would
    never happen (the wait times out and returns False)."""
    released = threading.Event()

    class Rendezvous(Environment):
        def step(self, assistant_message, state):
            if state == "A":
                return StepResult(done=released.wait(timeout=30))
            released.set()
            return StepResult(done=True)

    async def both():
        env = Rendezvous()
        return await asyncio.gather(env.step({}, "A"), env.step({}, "B"))

    assert [result.done for result in asyncio.run(both())] == [True, True]


def test_environments_by_name_by_data_source_and_by_dotted_path(monkeypatch):
    monkeypatch.setattr(environment, "ENVIRONMENTS", Registry("environment"))
    monkeypatch.setattr(environment, "ENVIRONMENT_SOURCES", {})
    register_environment("countdown", "count", data_sources=("games/countdown",))(CountdownGame)
    assert environment_class("countdown") is CountdownGame and environment_class("count") is CountdownGame
    assert environment_class(data_source="games/countdown") is CountdownGame
    assert environment_class("aligner_ext.agents.environment:Environment") is Environment
    with pytest.raises(KeyError, match="none is registered for data_source 'gsm8k'; data sources with an "
                                       "environment: games/countdown"):
        environment_class(data_source="gsm8k")
    with pytest.raises(KeyError, match="unknown environment 'countdwn'; known: count, countdown"):
        environment_class("countdwn")


def test_registration_refuses_non_environments_and_a_data_source_taken_twice(monkeypatch):
    monkeypatch.setattr(environment, "ENVIRONMENTS", Registry("environment"))
    monkeypatch.setattr(environment, "ENVIRONMENT_SOURCES", {})
    with pytest.raises(TypeError, match="must be a subclass of aligner_ext.agents.environment.Environment"):
        register_environment("plain")(dict)
    register_environment("echo", data_sources=("echo",))(AsyncEcho)
    with pytest.raises(ValueError, match="mapped to both environments 'echo' and 'countdown'"):
        register_environment("countdown", data_sources=("echo",))(CountdownGame)
    with pytest.raises(TypeError, match="must be a subclass"):
        environment_class("aligner_ext.registry:Registry")
