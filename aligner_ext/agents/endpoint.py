"""Agent sessions behind an OpenAI-compatible chat-completions endpoint, recorded token-exact.

Agent code written with the `openai` SDK (a tool-calling loop, an agent framework) is the rollout: it
talks to `POST /sessions/<session>/v1/chat/completions`, so its client's `base_url` is
`http://host/sessions/<session>/v1`, one per episode (the trainer gives each agent call a client made so;
`aligner-ext serve` takes any session name). The session is in the path rather than in a header or the
`user` field so that agent code passes nothing: the client it is given carries it.

A session is an episode's conversation as token ids (agents/tokens.py). Each request is one model turn:
- the first request's messages (and `tools`) are rendered with the chat template as a new training row's
  prompt; each later request's messages must start with the conversation as the client knows it (the
  previous request's messages and the assistant message answered to it, compared after normalising:
  content parts joined, tool-call arguments read as JSON); then only the new messages are encoded, as
  the suffix the template adds (ChatRenderer.add_messages): earlier turns are never encoded again;
- a request that does not extend the session (the agent edited or dropped history, asked the same
  messages again, or changed its tools) starts a new training row from its whole conversation, counted
  in `edited_history`; a template that rewrites history splits the row too (`history_rewrites`);
- the turn is sampled on the engine's turn session (generation/turns.py) under the session's name, so
  it continues on the KV cache its previous turn left; its ids are appended as sampled, with the
  engine's log-probs. The answer carries `tool_calls` (arguments as a JSON string, ids `call_<turn>_<i>`)
  read in the chat template's format, and the sampled ids as the choice's `token_ids` (vLLM's name)
  beside `prompt_token_ids`, the ids the turn continued.

Sampling is the endpoint's own (the trainer's rollout settings; serve: the policy's distribution at
temperature 1): a request's temperature, top_p, top_k, stop and seed are ignored, since the trainer's
log-probs must be those of what it samples; `max_tokens` (or `max_completion_tokens`) caps the turn.
Turn t of a session seeded s samples with request_seed(s, t). Limits (agents.limits) answer a refused
turn with an OpenAI error and record the end: `max_turns`, `max_total_tokens` (code
`context_length_exceeded`), `max_observation_tokens` (new messages' contents cut, counted).

The engine's turn session is touched by the driver only (`drive`, one coroutine): submissions and
releases are queued and applied before each step, so a step may run in a worker thread (serve, under its
engine lock) or on the event loop (the trainer) alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from aligner_ext.agents.episodes import extend_row, read_turn, readable, truncated
from aligner_ext.agents.settings import EpisodeLimits
from aligner_ext.agents.tokens import ChatRenderer, Trajectory
from aligner_ext.agents.tool_calls import ToolCallFormat, tool_call_format
from aligner_ext.api_errors import ApiError, shown
from aligner_ext.errors import ConfigError
from aligner_ext.generation.base import GenerationOutput
from aligner_ext.generation.sampler import request_seed

ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatRequest(BaseModel):
    """The chat-completions fields a session reads; the others (sampling settings among them) are ignored."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    n: int = 1
    stream: bool = False
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # seeds a session its first request opens (serve)


@dataclass
class AgentSession:
    """One episode's conversation: its training rows, and the conversation as the client knows it."""

    key: str
    seed: int
    rows: list[Trajectory] = field(default_factory=list)
    renderer: ChatRenderer | None = None
    tools: list[dict[str, Any]] | None = None
    known: list[dict[str, Any]] = field(default_factory=list)  # normalised: the last request's messages and our answer
    counts: Counter = field(default_factory=Counter)  # turns, tool_calls, edited_history, ... as an episode counts them
    last_finish: str = ""
    final_text: str = ""  # the last turn's content, readable
    end: str | None = None  # the limit a turn was refused for
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class SessionEndpoint:
    """Sessions by name over a turn session that `open_turns()` opens (agents/sessions.py), sampling with
    the endpoint's settings; `run_step(step)` runs one engine step (on the loop, or in a thread under a
    lock) and returns its result."""

    def __init__(self, tokenizer: Any, open_turns: Callable[[], Any], limits: EpisodeLimits, model_name: str,
                 max_new_tokens: int, run_step: Callable[[Callable[[], Any]], Awaitable[Any]] | None = None,
                 open_on_request: bool = False, max_sessions: int | None = None, max_chars: int | None = None):
        self.tokenizer, self.open_turns, self.limits = tokenizer, open_turns, limits
        self.model_name, self.max_new_tokens = model_name, max_new_tokens
        self.run_step = run_step or _on_the_loop
        self.open_on_request, self.max_sessions, self.max_chars = open_on_request, max_sessions, max_chars
        self.sessions: dict[str, AgentSession] = {}
        self.waiting: dict[str, asyncio.Future] = {}  # session -> its turn's output
        self.queue: list[tuple[str, str, tuple]] = []  # ("submit" | "release", session, (ids, budget, seed)) for the next step
        self.mutex = threading.Lock()  # the queue, between the event loop and a step in a worker thread
        self.wake = asyncio.Event()
        self.driver: asyncio.Task | None = None
        # touched by steps only
        self.turns: Any = None  # opened by the first step
        self.submitted: dict[str, tuple[list[int], int, int]] = {}  # session -> its turn in progress (resubmitted on reopen)
        self.stale = False  # the weights changed, or a step failed: reopen the turn session before the next step
        self.failure: BaseException | None = None  # the last step that raised
        self.stats: Counter = Counter()  # the turn sessions' counts, summed

    # sessions

    def open(self, key: str, seed: int) -> AgentSession:
        session = self.sessions[key] = AgentSession(key, seed)
        return session

    def close(self, key: str) -> AgentSession | None:
        """End a session: its turn in progress is dropped, its slot freed; the session as it stands."""
        session = self.sessions.pop(key, None)
        if session is not None:
            self._release(key, ApiError(409, f"session {shown(key)!r} was closed while its turn was sampled"))
        return session

    def session(self, key: str, request: ChatRequest) -> AgentSession:
        if key in self.sessions:
            return self.sessions[key]
        if not self.open_on_request:
            raise ApiError(404, f"no session {shown(key)!r}: each episode's client has its own base_url",
                           code="session_not_found")
        if self.max_sessions is not None and len(self.sessions) >= self.max_sessions:
            raise ApiError(429, f"{len(self.sessions)} sessions are open, the most this server keeps; DELETE "
                                "finished ones (/sessions/<session>)", code="too_many_sessions")
        return self.open(key, request.seed if request.seed is not None else time.time_ns())

    def weights_changed(self) -> None:
        """The policy's weights changed: the kept caches belong to the old ones (turns in progress restart)."""
        self.stale = True

    # one turn

    async def complete(self, key: str, request: ChatRequest) -> dict[str, Any]:
        """Answer one chat-completions request of session `key` (module docstring)."""
        if request.model is not None and request.model != self.model_name:
            raise ApiError(404, f"The model `{shown(request.model)}` does not exist; this endpoint serves "
                                f"`{self.model_name}`", code="model_not_found", param="model")
        if request.stream or request.n != 1:
            raise ApiError(400, "a session samples one turn at a time: ask with n=1 and without streaming",
                           param="stream" if request.stream else "n")
        characters = len(json.dumps(request.messages)) + len(json.dumps(request.tools or []))
        if self.max_chars is not None and characters > self.max_chars:  # before the loop renders and encodes them
            raise ApiError(400, f"the messages and tools take {characters} characters of JSON, more than this "
                                f"endpoint's {self.max_chars}", code="context_length_exceeded", param="messages")
        session = self.session(key, request)
        async with session.lock:  # one turn at a time per session
            messages = [normalised(message, index) for index, message in enumerate(request.messages)]
            turn = session.counts["turns"]
            if turn >= self.limits.max_turns:
                session.end = "max_turns"
                raise ApiError(400, f"the session has had its agents.limits.max_turns={self.limits.max_turns} turns",
                               code="max_turns_exceeded")
            trajectory = self._row_for(session, messages, request.tools or None)
            room = self.limits.max_total_tokens - len(trajectory.ids) if trajectory is not None else 0
            budget = min(request.max_completion_tokens or request.max_tokens or self.max_new_tokens,
                         self.max_new_tokens, room)
            if budget < 1:
                session.end = "max_total_tokens"
                raise ApiError(400, f"the session's conversation fills agents.limits.max_total_tokens="
                                    f"{self.limits.max_total_tokens} tokens", code="context_length_exceeded")
            try:  # before sampling: a template that renders no tool calls cannot answer `tools`
                call_format = tool_call_format(self.tokenizer) if session.tools else None
            except ConfigError as err:
                raise ApiError(400, str(err), param="tools") from err
            prompt_ids = list(trajectory.ids)
            output = await self._sample(key, prompt_ids, budget, request_seed(session.seed, turn))
            return self._answer(session, trajectory, messages, prompt_ids, output, call_format)

    def _row_for(self, session: AgentSession, messages: list[dict], tools: list[dict] | None) -> Trajectory | None:
        """The row the turn continues: the last one extended by the new messages, or a new one; None when
        the new messages do not fit in max_total_tokens."""
        known = len(session.known)
        try:
            if session.rows and tools == session.tools and len(messages) > known and messages[:known] == session.known:
                new = [truncated(self.tokenizer, self.limits, message, session.counts) for message in messages[known:]]
                return extend_row(session.renderer, session.rows, new, session.counts, self.limits.max_total_tokens,
                                  f"session {session.key}")
            if session.rows:
                session.counts["edited_history"] += 1
            session.renderer, session.tools = ChatRenderer(self.tokenizer, tools), tools
            row = session.renderer.start(messages)
        except Exception as err:  # noqa: BLE001 - the template cannot render what the client sent
            raise ApiError(400, f"cannot render the messages with the chat template: {shown(str(err))}",
                           param="messages") from err
        if len(row.ids) >= self.limits.max_total_tokens:
            return None
        session.rows.append(row)
        return row

    def _answer(self, session: AgentSession, trajectory: Trajectory, messages: list[dict], prompt_ids: list[int],
                output: GenerationOutput, call_format: ToolCallFormat | None) -> dict[str, Any]:
        """Record the turn on the row and answer it in OpenAI's shape."""
        parsed = read_turn(self.tokenizer, call_format, output, session.tools)
        session.renderer.add_turn(trajectory, output.token_ids, parsed.message(), output.logprobs)
        turn = session.counts["turns"]
        session.counts.update(turns=1, tool_calls=len(parsed.calls), malformed_calls=len(parsed.malformed))
        session.last_finish, session.final_text = output.finish_reason, readable(self.tokenizer, parsed.content)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content or (None if parsed.tool_calls else "")}
        if parsed.tool_calls:
            message["tool_calls"] = [{"id": f"call_{turn}_{index}", "type": "function",
                                      "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                                     for index, call in enumerate(parsed.tool_calls)]
        session.known = messages + [normalised(message, len(messages))]
        finish = "tool_calls" if parsed.tool_calls else "length" if output.finish_reason == "length" else "stop"
        return {"id": f"chatcmpl-{session.key}-{turn}", "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "prompt_token_ids": prompt_ids,
                "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None,
                             "token_ids": output.token_ids}],
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(output.token_ids),
                          "total_tokens": len(prompt_ids) + len(output.token_ids)}}

    async def _sample(self, key: str, ids: list[int], budget: int, seed: int) -> GenerationOutput:
        if self.driver is None or self.driver.done():
            self.driver = asyncio.ensure_future(self.drive())
        future = self.waiting[key] = asyncio.get_running_loop().create_future()
        self._queue("submit", key, (ids, budget, seed))
        try:
            return await future
        finally:
            if not future.done():  # the request was cancelled (its client left): drop the turn
                self._release(key, None)

    def _release(self, key: str, error: Exception | None) -> None:
        future = self.waiting.pop(key, None)
        if future is not None and not future.done() and error is not None:
            future.set_exception(error)
        self._queue("release", key, ())

    def _queue(self, action: str, key: str, turn: tuple) -> None:
        with self.mutex:
            self.queue.append((action, key, turn))
        self.wake.set()

    # the engine

    async def drive(self) -> None:
        """Run engine steps while turns wait or decode; hand each finished turn to its request. Runs
        until cancelled. A step that raises fails the turns waiting (500) and is kept in `failure`; the
        turn session is opened again for the next turns."""
        busy = False
        while True:
            if not (busy or self.queue):
                self.wake.clear()
                await self.wake.wait()
            try:
                finished, busy = await self.run_step(self._step)
            except Exception as err:  # noqa: BLE001 - the requests answer it; the trainer raises `failure`
                self.failure, self.stale, busy, finished = err, True, False, []
                self.submitted.clear()
                with self.mutex:  # the turns submitted meanwhile fail too
                    self.queue = [entry for entry in self.queue if entry[0] == "release"]
                waiting, self.waiting = self.waiting, {}
                for future in waiting.values():
                    if not future.done():
                        future.set_exception(ApiError(500, f"the engine failed: {type(err).__name__}: {err}"))
            for key, output in finished:
                future = self.waiting.pop(key, None)
                if future is not None and not future.done():
                    future.set_result(output)
            await asyncio.sleep(0)  # the requests whose turns finished go on

    def _step(self) -> tuple[list, bool]:
        """Apply the queued submissions and releases, run one step: (finished turns, whether any remain)."""
        if self.turns is None or self.stale:
            self._reopen()
        with self.mutex:
            queue, self.queue = self.queue, []
        for action, key, turn in queue:
            if action == "release":
                self.submitted.pop(key, None)
                self.turns.release(key)
            else:
                self.submitted[key] = turn
                self.turns.submit(key, *turn)
        if not self.turns.busy():
            return [], False
        finished = self.turns.step()
        for key, _ in finished:
            del self.submitted[key]
        return finished, self.turns.busy()

    def _reopen(self) -> None:
        """(Re)open the turn session; turns in progress start again on the new one (same seeds)."""
        if self.turns is not None:
            self.stats.update(self.turns.stats)
            self.turns.close()
        self.turns, self.stale = self.open_turns(), False
        for key, turn in self.submitted.items():
            self.turns.submit(key, *turn)

    async def stop(self) -> Counter:
        """Stop the driver and close the turn session: its counts and those of the sessions it replaced."""
        if self.driver is not None:
            self.driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.driver
        if self.turns is not None:
            self.stats.update(self.turns.stats)
            self.turns.close()
            self.turns = None
        return self.stats


async def _on_the_loop(step: Callable[[], Any]) -> Any:
    return step()


def normalised(message: Any, index: int) -> dict[str, Any]:
    """A client's message as the chat template takes it and as sessions compare it: role, content as a
    string (text parts joined, None as ""), name, tool_call_id, and tool calls with arguments as JSON
    objects (the OpenAI API sends a JSON string). 400 for a message a template cannot render."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise ApiError(400, f"{where} needs a role among {', '.join(ROLES)}", param=where)
    content = message.get("content")
    if isinstance(content, list):
        if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
            raise ApiError(400, f"{where}: only text content parts are served", param=where)
        content = "".join(str(part.get("text", "")) for part in content)
    elif content is not None and not isinstance(content, str):
        raise ApiError(400, f"{where}.content must be a string, a list of text parts or null", param=where)
    out: dict[str, Any] = {"role": message["role"], "content": content or ""}
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None:
            out[key] = message[key]
    if message.get("tool_calls"):
        out["tool_calls"] = [_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(message["tool_calls"])]
    return out


def _call(call: Any, where: str) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, f"{where} needs function.name", param=where)
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as err:
            raise ApiError(400, f"{where}.function.arguments is not JSON: {err.msg}", param=where) from err
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def session_routes(endpoint: SessionEndpoint, dependencies: list | None = None) -> APIRouter:
    """The session endpoints: chat completions, the model list, and (serve) a session's rows and its end."""
    router = APIRouter(dependencies=dependencies or [])

    @router.post("/sessions/{key}/v1/chat/completions")
    async def chat_completions(key: str, request: ChatRequest) -> dict:
        return await endpoint.complete(key, request)

    @router.get("/sessions/{key}/v1/models")
    async def models(key: str) -> dict:
        return {"object": "list", "data": [{"id": endpoint.model_name, "object": "model", "owned_by": "aligner-ext"}]}

    @router.get("/sessions/{key}")
    async def rows(key: str) -> dict:
        """The session's training rows: ids, each id's role, the engine's log-prob of each sampled id."""
        session = endpoint.sessions.get(key)
        if session is None:
            raise HTTPException(404, f"no session {shown(key)!r}")
        return {"rows": [{"ids": row.ids, "roles": row.roles, "logprobs": row.logprobs} for row in session.rows],
                "counts": dict(session.counts), "end": session.end}

    @router.delete("/sessions/{key}")
    async def end(key: str) -> dict:
        if endpoint.close(key) is None:
            raise HTTPException(404, f"no session {shown(key)!r}")
        return {"deleted": key}

    return router
