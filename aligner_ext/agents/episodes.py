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
from aligner_ext.agents.ranks import in_lockstep, split_play
from aligner_ext.agents.sessions import open_turns
from aligner_ext.agents.settings import AgentsConfig, EpisodeLimits
from aligner_ext.agents.tokens import ChatRenderer, Trajectory
from aligner_ext.agents.tool_calls import ParsedTurn, ToolCallFormat, tool_call_format
from aligner_ext.data.types import PromptDraw
from aligner_ext.errors import DataError, UserError
from aligner_ext.generation.base import GenerationEngine, GenerationOutput, SamplingParams
from aligner_ext.generation.sampler import request_seed
from aligner_ext.generation.sharded import RankSplitEngine
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
        # a rank split engine (torchrun): its inner engine plays this rank's share of the episodes (ranks.py)
        self.split = engine if isinstance(engine, RankSplitEngine) else None
        self.engine = engine.inner if self.split is not None else engine
        self.tokenizer, self.cfg = tokenizer, cfg
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
        tokens). `params.seed` seeds them (module docstring); `params.max_new_tokens` caps each turn.
        Under torchrun with a split engine, this rank plays its share and every rank returns them all (ranks.py)."""
        seed = params.seed if params.seed is not None else 0
        episodes = [(draw, request_seed(seed, position))
                    for position, draw in enumerate(draw for draw in draws for _ in range(n))]
        if self.split is None:
            return self._play(episodes, params)
        return split_play(lambda share: self._play(share, params), episodes, self.split.group)

    def _play(self, episodes: list[tuple[PromptDraw, int]], params: SamplingParams
              ) -> tuple[list[EpisodeOutcome], Counter]:
        """These (draw, seed) episodes on this rank's engine, in lockstep with the ranks that decode with it
        (which have the same share: none opens a session for an empty one)."""
        if not episodes:
            return [], Counter()
        played = [_Episode(self, draw, seed, params) for draw, seed in episodes]
        session = open_turns(self.engine, params, self.cfg.limits.max_total_tokens, self.cfg.max_concurrent_episodes)
        return in_lockstep(session, lambda turns: self._run_loop(turns, played))

    def _run_loop(self, session: Any, episodes: list[_Episode]) -> tuple[list[EpisodeOutcome], Counter]:
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
        call_format = self.runner.call_format() if episode.tools else None
        renderer = ChatRenderer(self.runner.tokenizer, episode.tools, call_format)
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
            parsed = read_turn(self.runner.tokenizer, call_format, output, episode.tools)
            counts["tool_calls"] += len(parsed.calls)
            counts["malformed_calls"] += len(parsed.malformed)
            renderer.add_turn(trajectory, output.token_ids, parsed.message(), output.logprobs, output.routing)
            outcome.last_finish, outcome.final_text = output.finish_reason, readable(self.runner.tokenizer, parsed.content)
            if len(trajectory.ids) >= self.limits.max_total_tokens:
                outcome.end = "max_total_tokens"
                break
            message = parsed.message()
            if parsed.malformed:
                message["malformed_tool_calls"] = [{"text": call.text, "problem": call.problem,
                                                    **({"id": call.id} if call.id else {})} for call in parsed.malformed]
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
            messages = [truncated(self.runner.tokenizer, self.limits, message, counts) for message in result.messages]
            trajectory = extend_row(renderer, rows, messages, counts, self.limits.max_total_tokens,
                                    f"episode of row {self.draw.row.row_id}")
            if trajectory is None:
                outcome.end = "max_total_tokens"
                break
        try:
            score = await asyncio.wait_for(environment.score(episode.state), max(1.0, deadline - time.monotonic()))
        except Exception as err:  # noqa: BLE001
            return self._failed(err, "score", counts, outcome)
        outcome.score = RewardResult(float(score)) if isinstance(score, (int, float)) else score
        return outcome

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


def read_turn(tokenizer: Any, call_format: ToolCallFormat | None, output: GenerationOutput,
              tools: list[dict[str, Any]] | None = None) -> ParsedTurn:
    """A model turn as a parsed message: its calls read in the template's format when the episode has
    tools (their schemas type the arguments of formats that write them untyped); else its text as
    sampled, less the end-of-sequence id that ended it (the template writes its own), so that the
    conversation re-renders to the sampled ids."""
    if call_format is not None:
        return call_format.parse(decoded(tokenizer, output.token_ids), tools)
    ids = output.token_ids[:-1] if output.finish_reason == "eos" else output.token_ids
    return ParsedTurn(decoded(tokenizer, ids))


def decoded(tokenizer: Any, ids: list[int]) -> str:
    """Sampled ids as text, special tokens included: what the chat template re-renders a turn from."""
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def readable(tokenizer: Any, content: str) -> str:
    """A turn's content without special tokens: what the reward registry reads."""
    return tokenizer.decode(tokenizer(content, add_special_tokens=False)["input_ids"], skip_special_tokens=True,
                            clean_up_tokenization_spaces=False)


def truncated(tokenizer: Any, limits: EpisodeLimits, message: dict, counts: Counter) -> dict:
    """The message with its content cut to max_observation_tokens tokens (the cut ones counted)."""
    content = message.get("content")
    if not isinstance(content, str):
        return message
    limit = limits.max_observation_tokens
    ids = tokenizer(content, add_special_tokens=False)["input_ids"]
    if len(ids) <= limit:
        return message
    counts["truncated_observation_tokens"] += len(ids) - limit
    side = limits.observation_truncation
    kept = ids[:limit] if side == "right" else ids[len(ids) - limit:] if side == "left" else \
        ids[: (limit + 1) // 2] + ids[len(ids) - limit // 2:]
    return {**message, "content": tokenizer.decode(kept, skip_special_tokens=True)}


def extend_row(renderer: ChatRenderer, rows: list[Trajectory], messages: list[dict], counts: Counter,
               max_total_tokens: int, label: str) -> Trajectory | None:
    """Append the observation to the last row (or start a new row where the template rewrote history,
    counted); None when it does not fit in max_total_tokens (the row is left as it was)."""
    trajectory = rows[-1]
    kept = (len(trajectory.ids), len(trajectory.text), len(trajectory.messages))
    extension = renderer.add_messages(trajectory, messages)
    if extension.rewrites_history:
        counts["history_rewrites"] += 1
        logger.debug("%s: a new training row (%s)", label, extension.reason)
        trajectory = renderer.start(trajectory.messages + messages)
        if len(trajectory.ids) >= max_total_tokens:
            return None
        rows.append(trajectory)
        return trajectory
    if len(trajectory.ids) >= max_total_tokens:
        ids, text, message_count = kept
        for values in (trajectory.ids, trajectory.roles, trajectory.logprobs):
            del values[ids:]
        trajectory.text, trajectory.messages = trajectory.text[:text], trajectory.messages[:message_count]
        return None
    counts["observation_tokens"] += len(extension.observation_ids)
    counts["template_tokens"] += len(extension.template_ids)
    return trajectory


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
        await _stop_at_a_failure(tasks)
        pending = {task for task in pending if not task.done()}
    return [task.result() for task in tasks]


async def _stop_at_a_failure(tasks: list[asyncio.Task]) -> None:
    """An episode that raised (a UserError: `_Episode._failed`) stops the run now, not once every other
    episode has ended (one may be waiting on a tool for minutes); the others are cancelled and their
    ends collected, so asyncio reports none of them as never retrieved."""
    failed = next((task for task in tasks if task.done() and not task.cancelled() and task.exception()), None)
    if failed is None:
        return
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    raise failed.exception()
