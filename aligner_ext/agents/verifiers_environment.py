"""`VerifiersEnvironment`: a verifiers environment (PyPI `verifiers`, tested with 0.4.0) run unchanged
through our environment interface.

verifiers 0.4.0 (`verifiers.v1`) has no environment object that answers turns: an environment is a
taskset (its tasks, each with `@vf.stop` conditions and `@vf.reward` / `@vf.metric` functions), an `Env`
that plays a task with an agent (`SingleAgentEnv`, or its own `run` talking to the agent turn by turn),
and a harness: an agent program that calls the model at an OpenAI-compatible endpoint the rollout
intercepts (`interception`), and calls the task's MCP tools. So the model is a `Client` of verifiers'
interception server, and that is where our episode loop takes each turn:

    class ReverseText(VerifiersEnvironment):
        ENV_ID = "reverse_text"            # the taskset's module, loaded by vf.load_environment
    rows = ReverseText.rows                # data.builtin_task=my_module:rows

- The environment is loaded by verifiers' own loading: `vf.load_environment(vf.resolve_env_config(
  {"taskset": {"id": ENV_ID}, ...}))` (`ENV_ARGS` adds settings). Its agent runs under
  `verifiers_harness.InProcessChat` (verifiers' `null` chat program, in this process: no uv) on the
  `subprocess` runtime, and its interception is one `server` whose model client is ours.
- Rows (decision): the taskset's tasks become our rows (`rows(split, size, seed)`, a built-in task
  function): the task's prompt as messages, `data_source` `verifiers/<ENV_ID>`, the task's key in
  `extra_info.verifiers_task` (and its data's `answer`, when it has one, as `extra_info.gold_solution`,
  for the embedded model's warm-up); a task belongs to the val split by the hash of its key
  (data/tasks/base.py).
- `reset(row)`: `env.run_episode(task, ...)` starts; its first model request's messages and tools are
  the episode's first messages and tools.
- `step(message)`: our turn is the model's response to that request; the episode waits for the next
  request (its new messages: tool results, the env's user turns) or for the rollout's end (done: the
  harness finished, a `@vf.stop` held, a limit).
- `score(state)`: the finished trace's reward (its rubric: the task's weighted `@vf.reward`s); its
  parsers are the task's own code over the trace. A rollout that failed (verifiers recorded an error)
  raises, so the episode ends as an environment error (episodes.py: one logged line, counted).

Bridging: our assistant messages carry `tool_calls[].function.arguments` as a JSON object; the model
response verifiers receives carries them as a JSON string, with an `id` per call (`call_<turn>_<i>`),
as the OpenAI API does; tool messages come back with that `tool_call_id`.

verifiers' machinery (its aiohttp interception server, its tasks) runs on an event loop of its own in a
daemon thread, kept for the environment's lifetime, while our episode loops come and go per step.
Single-agent environments only: a second agent's trace in one episode is refused.
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import json
import sys
import threading
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from aligner_ext.agents.environment import Environment, Episode, Message, StepResult
from aligner_ext.data.tasks.base import draw_from_pool, in_split, split_rng
from aligner_ext.data.types import PromptRow
from aligner_ext.errors import DataError, UserError
from aligner_ext.rewards.base import RewardResult

INSTALL = ("pip install 'aligner_ext[verifiers]' (or, keeping the pinned openai, "
           "pip install --no-deps verifiers==0.4.0 && pip install -r docker/verifiers-requirements.txt)")
HARNESS = "aligner_ext_verifiers_chat"  # verifiers imports a harness by a top-level module name: verifiers_harness.py's alias
MODEL = "policy"  # the model name the harness asks for; our client answers every name


def require_verifiers() -> Any:
    """`verifiers.v1`, or one line saying how to install it."""
    try:
        import verifiers.v1 as vf
    except ImportError as err:
        raise UserError(f"a verifiers environment needs the package verifiers ({err}); install it with: "
                        f"{INSTALL}") from err
    sys.modules.setdefault(HARNESS, importlib.import_module("aligner_ext.agents.verifiers_harness"))
    return vf


@dataclass
class VerifiersEpisode:
    """One rollout: its events (model requests, then its end), the request waiting for our turn, the
    conversation verifiers has sent so far, and the finished verifiers `Episode`."""

    events: asyncio.Queue
    rollout: asyncio.Task | None = None
    trace_ids: list[str] = field(default_factory=list)
    waiting: asyncio.Future | None = None  # our answer to the last request
    sent: list[dict] = field(default_factory=list)  # the messages of the last request
    turns: int = 0


class VerifiersEnvironment(Environment):
    """A verifiers environment's rollouts as episodes (module docstring). Subclasses set `ENV_ID`."""

    ENV_ID = ""  # the verifiers taskset (its module name), as `vf-eval <id>` takes it
    ENV_ARGS: dict[str, Any] = {}  # more of verifiers' EnvConfig, e.g. {"taskset": {"dataset_split": "test"}}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        require_verifiers()  # when the run's environment is imported, before any model loads

    @classmethod
    def env_config(cls) -> Any:
        """verifiers' EnvConfig of this environment (module docstring)."""
        vf = require_verifiers()
        if not cls.ENV_ID:
            raise UserError(f"{cls.__name__} names no verifiers environment: set its ENV_ID to the taskset's module name")
        args = dict(cls.ENV_ARGS)
        config = {**args, "taskset": {**args.get("taskset", {}), "id": cls.ENV_ID},
                  "interception": {"type": "server"},
                  "agent": {**args.get("agent", {}), "harness": {"id": HARNESS}, "runtime": {"type": "subprocess"}}}
        return vf.resolve_env_config(config)

    @classmethod
    def rows(cls, split: str, size: int, seed: int) -> list[PromptRow]:
        """`size` rows of the taskset's tasks of `split`: a built-in task function (module docstring)."""
        vf = require_verifiers()
        taskset = vf.load_taskset(cls.env_config().taskset)
        if not taskset.bounded:
            raise DataError(f"verifiers taskset {cls.ENV_ID!r} is infinite: bound it in ENV_ARGS "
                            "(e.g. {'taskset': ...}) before it can give rows")
        pool = [task for task in taskset if in_split(task.key, split)]
        if not pool:
            raise DataError(f"verifiers taskset {cls.ENV_ID!r} has no task in the {split} split")
        source = f"verifiers/{cls.ENV_ID}"
        return [PromptRow(f"{source}/{split}:{index}", task_messages(task.data), source, extra_info=task_info(task))
                for index, task in enumerate(draw_from_pool(pool, size, split_rng(source, split, seed)))]

    def __init__(self) -> None:
        vf = require_verifiers()
        self.env = vf.load_environment(self.env_config())
        self.tasks = {task.key: task for task in self.env.taskset} if self.env.taskset.bounded else {}
        self.client = EpisodeClient()
        self.context = vf.ModelContext(model=MODEL, client=vf.TrainClientConfig(base_url="http://127.0.0.1:1/v1",
                                                                                 api_key_var="ALIGNER_EXT_UNUSED"))
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name=f"verifiers-{self.ENV_ID}", daemon=True).start()
        self.serving = AsyncExitStack()
        asyncio.run_coroutine_threadsafe(self._serve(), self.loop).result()
        atexit.register(self.close)

    def close(self) -> None:
        """Release verifiers' serving resources (at exit: its loop's thread is a daemon)."""
        if not self.loop.is_closed():
            asyncio.run_coroutine_threadsafe(self.serving.aclose(), self.loop).result(timeout=30)
            self.loop.call_soon_threadsafe(self.loop.stop)

    async def _serve(self) -> None:
        """Hold the environment's serving resources (its interception server) for our lifetime; the
        server's client for our model config is ours (a TrainClientConfig, so a streamed request is
        answered from our whole response rather than relayed)."""
        await self.serving.enter_async_context(self.env.serving())
        self.env._interception.clients[self.context.client.model_dump_json()] = self.client

    async def reset(self, row: PromptRow) -> Episode:
        key = row.extra_info.get("verifiers_task")
        if key not in self.tasks:
            raise DataError(f"row {row.row_id}: extra_info.verifiers_task names no task of verifiers taskset "
                            f"{self.ENV_ID!r}; take the rows from {type(self).__name__}.rows")
        state = VerifiersEpisode(asyncio.Queue())
        body = await self._in_loop(self._start(self.tasks[key], state), state)
        return Episode([wire_message(message) for message in body["messages"]], body.get("tools") or [], state)

    async def step(self, assistant_message: Message, state: VerifiersEpisode) -> StepResult:
        body = await self._in_loop(self._answer(assistant_message, state), state)
        if body is None:
            return StepResult(done=True)
        answered = len(state.sent)
        if len(body["messages"]) <= answered or body["messages"][answered].get("role") != "assistant":
            raise RuntimeError(f"the verifiers harness's request does not continue the conversation after our turn "
                               f"({len(body['messages'])} messages, {answered} before our turn)")
        new = body["messages"][answered + 1:]  # after the conversation we were shown and our answer
        state.sent = body["messages"]
        return StepResult([wire_message(message) for message in new])

    async def score(self, state: VerifiersEpisode) -> RewardResult:
        episode = await self._in_loop(state.rollout, state)
        errors = recorded_errors(episode)
        if errors:
            raise RuntimeError(f"verifiers recorded {errors[0].type}: {errors[0].message}")
        (trace,) = episode.traces
        return RewardResult(trace.reward, info={"verifiers_stop": trace.stop_condition or ""})

    async def _in_loop(self, work: Any, state: VerifiersEpisode) -> Any:
        """Await `work` on verifiers' loop; if we stop waiting (a failure, our time limit), the rollout
        is cancelled there too."""
        future = asyncio.run_coroutine_threadsafe(_awaited(work), self.loop)
        try:
            return await asyncio.wrap_future(future)
        except BaseException:
            if state.rollout is not None:
                self.loop.call_soon_threadsafe(state.rollout.cancel)
            raise

    async def _start(self, task: Any, state: VerifiersEpisode) -> dict:
        def minted(trace: Any) -> None:
            state.trace_ids.append(trace.id)
            self.client.episodes[trace.id] = state

        def ended(_: asyncio.Task) -> None:
            for trace_id in state.trace_ids:
                self.client.episodes.pop(trace_id, None)
            state.events.put_nowait(None)

        state.rollout = asyncio.ensure_future(self.env.run_episode(task, self.context, on_trace=minted))
        state.rollout.add_done_callback(ended)
        body = await self._next_request(state)
        if body is None:
            errors = recorded_errors(state.rollout.result())
            raise RuntimeError("the verifiers rollout ended before its first model call"
                               + (f": {errors[0].type}: {errors[0].message}" if errors else ""))
        state.sent = body["messages"]
        return body

    async def _answer(self, message: Message, state: VerifiersEpisode) -> dict | None:
        state.turns += 1
        state.waiting.set_result(completion(message, state.turns))
        return await self._next_request(state)

    async def _next_request(self, state: VerifiersEpisode) -> dict | None:
        """The next model request of the rollout, or None when it has ended."""
        event = await state.events.get()
        if event is None:
            return None
        if len(state.trace_ids) > 1:
            raise RuntimeError(f"verifiers environment {self.ENV_ID!r} runs several agents in one episode; "
                               "only single-agent environments are episodes here")
        body, state.waiting = event
        return body


class EpisodeClient:
    """verifiers' model client: each request of a rollout waits for its episode's turn (module docstring).
    Duck-typed against `verifiers.v1.clients.Client` so that this module imports without verifiers."""

    def __init__(self) -> None:
        self.episodes: dict[str, VerifiersEpisode] = {}

    async def get_response(self, dialect: Any, body: dict, sampling: Any, session_id: str | None = None,
                           turn: Any = None, headers: Any = None) -> Any:
        answer = asyncio.get_running_loop().create_future()
        await self.episodes[session_id].events.put((body, answer))
        raw = await answer
        response = dialect.parse_response(dialect.validate_response(raw))
        response.raw = raw
        return response

    async def close(self) -> None:
        """Nothing to close: no connection of its own."""


def completion(message: Message, turn: int) -> dict:
    """Our assistant message as an OpenAI chat completion: tool-call arguments as JSON strings, an id per call."""
    calls = [{"id": f"call_{turn}_{index}", "type": "function",
              "function": {"name": call["function"]["name"], "arguments": json.dumps(call["function"]["arguments"])}}
             for index, call in enumerate(message.get("tool_calls") or ())]
    reply: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if calls:
        reply["tool_calls"] = calls
    return {"id": f"turn-{turn}", "object": "chat.completion", "created": int(time.time()), "model": MODEL,
            "choices": [{"index": 0, "message": reply, "finish_reason": "tool_calls" if calls else "stop"}]}


def wire_message(message: dict) -> Message:
    """A message of a request as ours: text content as a string, tool-call arguments as JSON objects."""
    ours = dict(message)
    if isinstance(ours.get("content"), list):
        ours["content"] = "".join(part.get("text", "") for part in ours["content"] if isinstance(part, dict))
    if ours.get("tool_calls"):
        ours["tool_calls"] = [{**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"] or "{}")}}
                              for call in ours["tool_calls"]]
    return ours


def recorded_errors(episode: Any) -> list[Any]:
    """The errors verifiers recorded on a finished episode and on its traces."""
    return [*episode.errors, *(error for trace in episode.traces for error in trace.errors)]


def task_info(task: Any) -> dict[str, Any]:
    """A row's extra_info: the task's key, and its data's `answer` (verifiers' examples name the reference
    so) as the gold solution the embedded model's supervised warm-up learns."""
    answer = getattr(task.data, "answer", None)
    return {"verifiers_task": task.key, **({"gold_solution": answer} if isinstance(answer, str) and answer else {})}


def task_messages(data: Any) -> list[Message]:
    """A verifiers task's prompt as chat messages (what our row holds; the episode's come from the harness)."""
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return messages + [{"role": "user", "content": data.prompt}]
    return messages + [wire_message(message.model_dump(exclude_none=True)) for message in data.prompt or ()]


async def _awaited(work: Any) -> Any:
    return await work

