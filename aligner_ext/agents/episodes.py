"""The episode loop: n episodes of each prompt draw, run concurrently, each turn token-exact.

One episode, as `_Episode.run` plays it:

    reset(row) -> the first messages and tools -> the prompt ids (tokens.py: `ChatRenderer.start`)
    turn:  the session samples a turn continuing the trajectory's ids (sessions.py)
           its tool calls are read from the sampled text (tool_calls.py, in the family's format)
           the sampled ids are appended as sampled, with the engine's log-prob of each
           step(assistant message) -> new messages, a per-turn reward, done
           the new messages' contents are cut to `max_observation_tokens`, and their tokens are the
           suffix the chat template adds (a template that rewrites history starts a new row)
    ... until the environment says done or a limit ends it; then score(state), or the reward registry

Episodes are asyncio tasks in one event loop; the engine works between their awaits (`_drive`): while
any turn waits or decodes it runs one bounded session step and yields, so an episode whose tool runs
(in a worker thread, a subprocess, a server) holds no other episode back, and a turn that finishes is
handed to its episode at once. With the rollout engine's session the episode keeps its KV cache while
its tool runs; its next turn prefills the new ids only.

Limits (settings.py, `agents.limits`) end an episode deterministically, each counted under its
reason in `EpisodeOutcome.end`: `max_turns`; `max_total_tokens` (a turn samples at most what is left
of the row, and an observation that does not fit is dropped and ends the episode); the wall-clock
`max_episode_seconds`, checked before each turn and bounding each environment call (a call it cuts short
is logged in one line). An environment
that raises ends its episode with `environment_error` (one logged line, counted; its reward 0), never
the run, unless it raises a UserError (a setting, a machine that cannot run the environment), which
stops the run with its one line. A row is the unit of training: several when the template rewrote history (tokens.py).

Seeds: turn t of episode e of a call seeded s samples with request_seed(request_seed(s, e), t), so
the same seeds give the same trajectories whatever order the environments answer in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from aligner_ext.agents.environment import Environment, environment_class
from aligner_ext.agents.sessions import open_turns
from aligner_ext.agents.settings import AgentsConfig, EpisodeLimits
from aligner_ext.agents.tokens import ChatRenderer, Trajectory
from aligner_ext.agents.tool_calls import ParsedTurn, ToolCallFormat, tool_call_format
from aligner_ext.data.types import PromptDraw
from aligner_ext.errors import DataError, UserError
from aligner_ext.generation.base import GenerationEngine, GenerationOutput, SamplingParams
from aligner_ext.generation.sampler import request_seed
from aligner_ext.rewards.base import RewardResult

logger = logging.getLogger(__name__)

ENDS = ("done", "max_turns", "max_total_tokens", "max_episode_seconds", "environment_error")


@dataclass
class EpisodeOutcome:
    """One finished episode: its training rows, what the environment scored, why it ended, its counts."""

    draw: PromptDraw
    rows: list[Trajectory]  # one, or several when the chat template rewrote history
    end: str  # one of ENDS
    last_finish: str  # the finish reason of the last model turn ("eos", "stop", "length")
    final_text: str  # the last model turn's content (what the reward registry scores when the environment does not)
    turn_rewards: float = 0.0  # the sum of the steps' per-turn rewards
    score: RewardResult | None = None  # the environment's final reward; None: the reward registry's
    counts: Counter = field(default_factory=Counter)  # turns, tool_calls, malformed_calls, observation tokens, ...


class EpisodeRunner:
    """Runs episodes on a generation engine; one instance per experience maker (it keeps the environments)."""

    def __init__(self, engine: GenerationEngine, tokenizer: Any, cfg: AgentsConfig):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.environments: dict[str, Environment] = {}
        self._format: ToolCallFormat | None = None

    def environment_for(self, draw: PromptDraw) -> Environment:
        """The environment of a row: `agents.environment`, or the one registered for its data_source."""
        name = None if self.cfg.environment == "auto" else self.cfg.environment
        cls = environment_class(name, draw.row.data_source)
        key = f"{cls.__module__}.{cls.__qualname__}"
        if key not in self.environments:
            self.environments[key] = cls()
        return self.environments[key]

    def call_format(self) -> ToolCallFormat:
        """The tool-call syntax of the tokenizer's chat template (read when an episode first offers tools)."""
        if self._format is None:
            self._format = tool_call_format(self.tokenizer)
        return self._format

    def run(self, draws: list[PromptDraw], n: int, params: SamplingParams) -> tuple[list[EpisodeOutcome], Counter]:
        """n episodes per draw, in (draw, copy) order, and the session's counts (prefilled and reused
        tokens). `params.seed` seeds them (module docstring); `params.max_new_tokens` caps each turn."""
        seed = params.seed if params.seed is not None else 0
        episodes = [_Episode(self, draw, request_seed(seed, position), params)
                    for position, draw in enumerate(draw for draw in draws for _ in range(n))]
        session = open_turns(self.engine, params, self.cfg.limits.max_total_tokens, self.cfg.max_concurrent_episodes)
        # Our own loop and worker threads: a plain environment method that hangs keeps its thread, and
        # asyncio.run would wait for it at shutdown; here the run goes on without it (docs/agents.md).
        loop = asyncio.new_event_loop()
        workers = ThreadPoolExecutor(max_workers=max(4, min(64, len(episodes))), thread_name_prefix="episode")
        loop.set_default_executor(workers)
        try:
            outcomes = loop.run_until_complete(_drive(session, episodes, self.cfg.max_concurrent_episodes))
        finally:
            loop.close()
            workers.shutdown(wait=False, cancel_futures=True)
            session.close()
        return outcomes, Counter(session.stats)


class _Episode:
    """One episode's coroutine and the turn it waits for."""

    def __init__(self, runner: EpisodeRunner, draw: PromptDraw, seed: int, params: SamplingParams):
        self.runner, self.draw, self.seed, self.params = runner, draw, seed, params
        self.limits: EpisodeLimits = runner.cfg.limits
        self.session: Any = None  # the turn session and the driver's wake-up event, set when the episode starts (`_drive`)
        self.wake: asyncio.Event | None = None
        self.turn: asyncio.Future | None = None  # the turn it waits for

    async def sample(self, ids: list[int], turn: int) -> GenerationOutput:
        """Submit a turn continuing `ids` and wait for the engine to finish it."""
        self.turn = asyncio.get_running_loop().create_future()
        budget = min(self.params.max_new_tokens, self.limits.max_total_tokens - len(ids))
        self.session.submit(self, ids, budget, request_seed(self.seed, turn))
        self.wake.set()
        return await self.turn

    async def run(self) -> EpisodeOutcome:
        started = time.monotonic()
        deadline = started + self.limits.max_episode_seconds
        environment = self.runner.environment_for(self.draw)
        counts: Counter = Counter()
        try:
            episode = await asyncio.wait_for(environment.reset(self.draw.row), self.limits.max_episode_seconds)
        except Exception as err:  # noqa: BLE001 - an environment's failure ends its episode, never the run
            return self._failed(err, "reset", counts)
        renderer = ChatRenderer(self.runner.tokenizer, episode.tools)
        call_format = self.runner.call_format() if episode.tools else None
        rows = [renderer.start(episode.messages)]
        if len(rows[0].ids) >= self.limits.max_total_tokens:
            raise DataError(f"row {self.draw.row.row_id}: its first messages take {len(rows[0].ids)} tokens, "
                             f"agents.limits.max_total_tokens={self.limits.max_total_tokens} leaves no room for a turn")
        outcome = EpisodeOutcome(self.draw, rows, "max_turns", "length", "", counts=counts)
        for turn in range(self.limits.max_turns):
            trajectory = rows[-1]
            if time.monotonic() >= deadline:
                outcome.end = "max_episode_seconds"
                break
            output = await self.sample(trajectory.ids, turn)
            counts["turns"] += 1
            parsed = call_format.parse(self._decode(output.token_ids)) if call_format else self._plain(output)
            counts["tool_calls"] += len(parsed.calls)
            counts["malformed_calls"] += len(parsed.malformed)
            renderer.add_turn(trajectory, output.token_ids, parsed.message(), output.logprobs)
            outcome.last_finish, outcome.final_text = output.finish_reason, self._readable(parsed.content)
            if len(trajectory.ids) >= self.limits.max_total_tokens:
                outcome.end = "max_total_tokens"
                break
            message = parsed.message()
            if parsed.malformed:
                message["malformed_tool_calls"] = [{"text": call.text, "problem": call.problem} for call in parsed.malformed]
            step_started = time.monotonic()
            try:
                result = await asyncio.wait_for(environment.step(message, episode.state),
                                                max(0.0, deadline - time.monotonic()))
            except Exception as err:  # noqa: BLE001
                return self._failed(err, "step", counts, outcome)
            counts["environment_seconds"] += time.monotonic() - step_started
            counts.update(result.metrics)
            outcome.turn_rewards += result.reward or 0.0
            if result.done:
                outcome.end = "done"
                break
            if turn == self.limits.max_turns - 1:
                break  # the last turn's observation is never answered, so never trained on
            messages = [self._truncated(message, counts) for message in result.messages]
            trajectory = self._extend(renderer, rows, messages, counts)
            if trajectory is None:
                outcome.end = "max_total_tokens"
                break
        try:
            score = await asyncio.wait_for(environment.score(episode.state), max(1.0, deadline - time.monotonic()))
        except Exception as err:  # noqa: BLE001
            return self._failed(err, "score", counts, outcome)
        outcome.score = RewardResult(float(score)) if isinstance(score, (int, float)) else score
        return outcome

    def _extend(self, renderer: ChatRenderer, rows: list[Trajectory], messages: list[dict], counts: Counter
                ) -> Trajectory | None:
        """Append the observation to the last row (or start a new row where the template rewrote
        history); None when it does not fit in max_total_tokens (the row is left as it was)."""
        trajectory = rows[-1]
        kept = (len(trajectory.ids), len(trajectory.text), len(trajectory.messages))
        extension = renderer.add_messages(trajectory, messages)
        if extension.rewrites_history:
            counts["history_rewrites"] += 1
            logger.debug("episode of row %s: a new training row (%s)", self.draw.row.row_id, extension.reason)
            trajectory = renderer.start(trajectory.messages + messages)
            if len(trajectory.ids) >= self.limits.max_total_tokens:
                return None
            rows.append(trajectory)
            return trajectory
        if len(trajectory.ids) >= self.limits.max_total_tokens:
            ids, text, message_count = kept
            for values in (trajectory.ids, trajectory.roles, trajectory.logprobs):
                del values[ids:]
            trajectory.text, trajectory.messages = trajectory.text[:text], trajectory.messages[:message_count]
            return None
        counts["observation_tokens"] += len(extension.observation_ids)
        counts["template_tokens"] += len(extension.template_ids)
        return trajectory

    def _truncated(self, message: dict, counts: Counter) -> dict:
        """The message with its content cut to max_observation_tokens tokens (the cut ones counted)."""
        content = message.get("content")
        if not isinstance(content, str):
            return message
        tokenizer, limit = self.runner.tokenizer, self.limits.max_observation_tokens
        ids = tokenizer(content, add_special_tokens=False)["input_ids"]
        if len(ids) <= limit:
            return message
        counts["truncated_observation_tokens"] += len(ids) - limit
        side = self.limits.observation_truncation
        kept = ids[:limit] if side == "right" else ids[len(ids) - limit:] if side == "left" else \
            ids[: (limit + 1) // 2] + ids[len(ids) - limit // 2:]
        return {**message, "content": tokenizer.decode(kept, skip_special_tokens=True)}

    def _decode(self, ids: list[int]) -> str:
        """Sampled ids as text, special tokens included: what the chat template re-renders a turn from."""
        return self.runner.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _plain(self, output: GenerationOutput) -> ParsedTurn:
        """A turn of an episode without tools: its text as sampled, less the end-of-sequence id that ended
        it (the template writes its own), so that the conversation re-renders to the sampled ids."""
        ids = output.token_ids[:-1] if output.finish_reason == "eos" else output.token_ids
        return ParsedTurn(self._decode(ids))

    def _readable(self, content: str) -> str:
        """A turn's content without special tokens: what the reward registry reads."""
        tokenizer = self.runner.tokenizer
        return tokenizer.decode(tokenizer(content, add_special_tokens=False)["input_ids"], skip_special_tokens=True,
                                clean_up_tokenization_spaces=False)

    def _failed(self, err: BaseException, method: str, counts: Counter,
                outcome: EpisodeOutcome | None = None) -> EpisodeOutcome:
        """An environment call raised or ran past the episode's time: the episode ends, rewarded 0. A
        UserError (a setting, a machine that cannot run the environment) stops the run instead."""
        if isinstance(err, UserError):
            raise err
        timed_out = isinstance(err, asyncio.TimeoutError)
        end = "max_episode_seconds" if timed_out else "environment_error"
        if timed_out:
            logger.warning("episode of row %s: the environment's %s ran past agents.limits.max_episode_seconds=%g; "
                           "the episode ends with reward 0", self.draw.row.row_id, method, self.limits.max_episode_seconds)
        else:
            logger.warning("episode of row %s: the environment's %s raised %s: %s; the episode ends with reward 0",
                           self.draw.row.row_id, method, type(err).__name__, err)
        if outcome is None:
            return EpisodeOutcome(self.draw, [], end, "", "", score=RewardResult(0.0, 0.0), counts=counts)
        outcome.end, outcome.score, outcome.turn_rewards = end, RewardResult(0.0, 0.0), 0.0
        return outcome


async def _drive(session: Any, episodes: list[_Episode], concurrency: int) -> list[EpisodeOutcome]:
    """Run the episodes (at most `concurrency` at once) and the engine between their awaits."""
    wake = asyncio.Event()
    limit = asyncio.Semaphore(concurrency)

    async def play(episode: _Episode) -> EpisodeOutcome:
        async with limit:
            episode.session, episode.wake = session, wake
            try:
                return await episode.run()
            finally:
                session.release(episode)

    tasks = [asyncio.ensure_future(play(episode)) for episode in episodes]
    pending = set(tasks)
    while pending:
        if session.busy():
            for episode, output in session.step():
                episode.turn.set_result(output)
            await asyncio.sleep(0)  # the episodes whose turns finished, and finished tools, go on
        else:
            wake.clear()
            woken = asyncio.ensure_future(wake.wait())
            await asyncio.wait(pending | {woken}, return_when=asyncio.FIRST_COMPLETED)
            woken.cancel()
        pending = {task for task in pending if not task.done()}
    return [task.result() for task in tasks]
