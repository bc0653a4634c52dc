"""Agent code as the rollout (agents.agent): the user's `async def agent(client, row)` plays each episode
against the session endpoint (endpoint.py) that the trainer serves on 127.0.0.1 during the step.

    async def agent(client: openai.AsyncOpenAI, row: PromptRow) -> float | RewardResult | list[dict] | None:
        messages = list(row.messages)
        response = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        ...

Each episode gets a client of its own whose base_url names its session, so its turns continue on the
engine's kept cache and are recorded token-exact; the episode's training rows are its session's. What
the function returns is the episode's reward: a number or a RewardResult; a list of messages (the
transcript), whose last assistant message the reward registry scores; or None, and the registry scores
the last sampled turn. The function runs on the trainer's event loop, so it must await (a blocking call
would stall every episode).

A function that raises ends its episode with `environment_error`, one logged line; one that runs past
agents.limits.max_episode_seconds is cancelled, `max_episode_seconds`, one logged line; either is
rewarded 0 and the run goes on (a UserError stops it, as an environment's does). A function that
raises after the endpoint refused a turn for a limit ends with that limit's reason (`max_turns`,
`max_total_tokens`) and no log line. Seeds: turn t of episode e of a call seeded s samples with
request_seed(request_seed(s, e), t), as environment episodes do.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import socket
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import openai
import uvicorn
from fastapi import FastAPI

from aligner_ext.agents.endpoint import AgentSession, SessionEndpoint, session_routes
from aligner_ext.agents.episodes import EpisodeOutcome
from aligner_ext.agents.sessions import open_turns
from aligner_ext.agents.settings import AgentsConfig
from aligner_ext.api_errors import answer_errors_as_openai
from aligner_ext.data.types import PromptDraw
from aligner_ext.errors import ConfigError, UserError
from aligner_ext.generation.base import GenerationEngine, SamplingParams
from aligner_ext.generation.sampler import request_seed
from aligner_ext.registry import load_dotted
from aligner_ext.rewards.base import RewardResult

logger = logging.getLogger(__name__)

MODEL_NAME = "policy"  # the model id the trainer's endpoint serves (and lists at /v1/models)


def agent_function(path: str) -> Callable[..., Any]:
    """The `async def agent(client, row)` at dotted path `path`; ConfigError naming agents.agent otherwise."""
    try:
        function = load_dotted(path)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"agents.agent={path}: {err}") from err
    if not inspect.iscoroutinefunction(function):
        raise ConfigError(f"agents.agent={path} is {function!r}; it must be an `async def agent(client, row)` "
                          "(it runs on the trainer's event loop beside every other episode)")
    return function


class AgentFunctionRunner:
    """Plays episodes with the agent function; the same `run` as EpisodeRunner's, so AgentEpisodes makes
    its batch rows alike."""

    def __init__(self, engine: GenerationEngine, tokenizer: Any, cfg: AgentsConfig):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.agent = agent_function(cfg.agent)

    def run(self, draws: list[PromptDraw], n: int, params: SamplingParams) -> tuple[list[EpisodeOutcome], Counter]:
        """n episodes per draw, in (draw, copy) order, and the turn session's counts."""
        seed = params.seed if params.seed is not None else 0
        episodes = [(draw, request_seed(seed, position))
                    for position, draw in enumerate(draw for draw in draws for _ in range(n))]
        loop = asyncio.new_event_loop()
        workers = ThreadPoolExecutor(max_workers=4, thread_name_prefix="agent")
        loop.set_default_executor(workers)
        try:
            return loop.run_until_complete(self._play(episodes, params))
        finally:
            loop.close()
            workers.shutdown(wait=False, cancel_futures=True)

    async def _play(self, episodes: list[tuple[PromptDraw, int]], params: SamplingParams
                    ) -> tuple[list[EpisodeOutcome], Counter]:
        limits = self.cfg.limits
        endpoint = SessionEndpoint(
            self.tokenizer, lambda: open_turns(self.engine, params, limits.max_total_tokens,
                                               self.cfg.max_concurrent_episodes),
            limits, MODEL_NAME, params.max_new_tokens)
        limit = asyncio.Semaphore(self.cfg.max_concurrent_episodes)

        http = openai.DefaultAsyncHttpxClient()  # one pool for every episode's client: one each took ~80 ms to make

        async def play(position: int, draw: PromptDraw, seed: int) -> EpisodeOutcome:
            async with limit:
                return await self._episode(endpoint, url, http, f"episode-{position}", draw, seed)

        try:
            async with serving(endpoint) as url:
                outcomes = await asyncio.gather(*(play(position, draw, seed)
                                                  for position, (draw, seed) in enumerate(episodes)))
        finally:
            await http.aclose()
            stats = await endpoint.stop()
        if endpoint.failure is not None:  # the engine, not an agent: the run stops as it would without agents
            raise endpoint.failure
        return list(outcomes), stats

    async def _episode(self, endpoint: SessionEndpoint, url: str, http: Any, key: str, draw: PromptDraw,
                       seed: int) -> EpisodeOutcome:
        limits = self.cfg.limits
        session = endpoint.open(key, seed)
        client = openai.AsyncOpenAI(base_url=f"{url}/sessions/{key}/v1", api_key="none", max_retries=0,
                                    timeout=limits.max_episode_seconds, http_client=http)
        end, score, final_text = "done", None, None
        try:
            returned = await asyncio.wait_for(self.agent(client, draw.row), limits.max_episode_seconds)
            score, final_text = episode_reward(returned)
        except UserError:
            raise
        except asyncio.TimeoutError:
            end, score = "max_episode_seconds", RewardResult(0.0, 0.0)
            logger.warning("episode of row %s: the agent function did not finish within agents.limits."
                           "max_episode_seconds=%s; the episode ends with reward 0", draw.row.row_id,
                           limits.max_episode_seconds)
        except Exception as err:  # noqa: BLE001 - an agent's failure ends its episode, never the run
            end, score = session.end or "environment_error", RewardResult(0.0, 0.0)
            if session.end is None:
                logger.warning("episode of row %s: the agent function raised %s: %s; the episode ends with "
                               "reward 0", draw.row.row_id, type(err).__name__, err)
        finally:
            endpoint.close(key)
        return outcome(draw, session, end, score, final_text)


def episode_reward(returned: Any) -> tuple[RewardResult | None, str | None]:
    """(score, text the registry scores) from what the agent function returned (module docstring)."""
    if isinstance(returned, RewardResult):
        return returned, None
    if isinstance(returned, (int, float)):
        return RewardResult(float(returned)), None
    if returned is None:
        return None, None
    if isinstance(returned, list) and all(isinstance(message, dict) for message in returned):
        answers = [message.get("content") or "" for message in returned if message.get("role") == "assistant"]
        return None, answers[-1] if answers else ""
    raise TypeError(f"the agent function returned {type(returned).__name__}; return a number, a RewardResult, "
                    "the transcript (a list of messages) or None")


def outcome(draw: PromptDraw, session: AgentSession, end: str, score: RewardResult | None,
            final_text: str | None) -> EpisodeOutcome:
    """The episode as the experience maker takes it: the session's rows that hold a sampled turn."""
    rows = [row for row in session.rows if "sampled" in row.roles]
    return EpisodeOutcome(draw, rows, end, session.last_finish,
                          session.final_text if final_text is None else final_text, score=score,
                          counts=session.counts)


class _QuietServer(uvicorn.Server):
    """uvicorn in the trainer's event loop: the trainer's own signal handlers stay (Ctrl-C, SIGTERM)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


@contextlib.asynccontextmanager
async def serving(endpoint: SessionEndpoint):
    """Serve `endpoint`'s sessions on 127.0.0.1 (a port the system picks) in this event loop; yield its URL."""
    app = FastAPI(title="aligner-ext agent sessions")
    answer_errors_as_openai(app)
    app.include_router(session_routes(endpoint))
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    server = _QuietServer(uvicorn.Config(app, log_level="error", lifespan="off", timeout_graceful_shutdown=10))
    task = asyncio.ensure_future(server.serve(sockets=[listener]))
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("the agent sessions' server stopped before it started")
            await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
        listener.close()
