"""Turn sessions: the turns of multi-turn episodes (an agent's tool calls and observations) decoded on the
rollout engine's KV cache, each episode continuing in the slot that holds its trajectory so far.

    session = engine.open_session(params, max_length, max_episodes)
    session.submit(key, ids, max_new_tokens, seed)   # a turn of episode `key`: continue `ids`, its whole trajectory
    while session.busy():
        for key, output in session.step(): ...       # admit waiting turns, one decode step: the turns it finished
    session.release(key)                             # the episode ended: its slot is free
    session.close()                                  # frees the cache

- Pinned slots. After a turn finishes, its slot keeps the K/V of the turn's ids and of its sampled
  tokens but the last (never fed back). The episode's next turn, when its ids extend exactly what the
  slot holds (checked token by token), prefills only its new tokens; otherwise it prefills all its ids,
  counted as recomputed.
- Memory pressure. The session has min(max_episodes, max_batch_size, what fits in kv_cache_memory_share
  on a GPU) slots of max_length positions each. A turn whose episode holds no slot takes a free one,
  else evicts the slot of the episode not generating whose last turn finished longest ago (counted);
  that episode's next turn prefills its whole ids again (recomputed). While every slot generates, a
  turn waits.
- Narrow steps. The decode step runs over slots [0, highest busy slot], so a turn whose episode holds
  a slot above a free one moves down with its K/V (a copy of the positions it holds, counted in
  `moves`): as a GRPO step's short episodes end, the long ones' steps narrow to the episodes left.
- Continuous batching across turns: a turn submitted between steps is admitted at the next `step`
  among the turns of other episodes still decoding, so a slow tool delays only its own episode.
- Exactness. A turn samples from the stream request_seed(seed, 0), the one `generate([ids], params with
  its max_new_tokens and seed)` gives its one request, so its tokens and log-probs are those of that
  fresh call (log-probs to float tolerance), whatever turns share its steps and in whatever order they
  come (tests/unit/generation/test_turn_sessions.py). Finishes are generate's: EOS unless ignore_eos,
  stop ids and strings, the turn's own max_new_tokens.

The machinery is the `generate` call's (batching.py: prefill from the positions a slot holds, identical
ids admitted together prefilled once, the decode step in CUDA graphs per rows bucket on a GPU, read
LOOKAHEAD steps late); the session's cache length is fixed, so its graphs are captured once per rows
bucket. Under tensor parallelism every rank of the decoder's `lockstep_group` must make the same calls
in the same order (the episode loop has one rank play and the others repeat: agents/ranks.py), and
their sessions take the fewest slots any of them fits. Not supported: expert parallelism (refused when
the session opens).

A mixture of experts asked with `return_routing` records the experts of every token the session feeds
(`decoder.RoutingRecord`, beside the KV cache, as in a `generate` call): a turn's prefilled tokens
write theirs, whether the whole ids or only the new tokens on the slot's kept positions, whose experts
its earlier turns recorded (a shared first prompt's are copied with its K/V), and each decode step
its own. A finished turn's output carries the experts of all its ids and sampled tokens but the last
(`GenerationOutput.routing`), the same as a `generate` call on its whole ids would return; the copies
reach the host once per `step` in which turns finished.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

import numpy as np
import torch

from aligner_ext.distributed import fewest
from aligner_ext.generation.base import GenerationOutput, SamplingParams
from aligner_ext.generation.batching import SlotBatcher, routing_on_host, weights_fingerprint
from aligner_ext.generation.hf import check_request
from aligner_ext.generation.sampler import request_seed
from aligner_ext.generation.stopping import StopStringMatcher


class TurnSession(SlotBatcher):
    """Turns of episodes sampled with `params` (its max_new_tokens and seed unused: each turn brings its
    own) on at most `max_episodes` slots of `max_length` positions. Module docstring."""

    def __init__(self, engine, params: SamplingParams, max_length: int, max_episodes: int):
        if engine.decoder.exchange is not None:
            raise NotImplementedError("turn sessions do not run under expert parallelism "
                                      "(policy.expert_model_parallel_size > 1)")
        check_request([], params)
        if max_length < 2 or max_episodes < 1:
            raise ValueError(f"open_session needs max_length >= 2 and max_episodes >= 1, got {max_length} and "
                             f"{max_episodes}")
        engine.release_memory()  # the last generate call's kept cache: the session keeps its own
        engine.decoder.refresh()
        matcher = StopStringMatcher(params.stop, lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=True))
        record_routing = params.return_routing and engine.decoder.records_routing
        slot_total = engine.slot_count(max_episodes, max_length, record_routing)
        self.lockstep_group = engine.decoder.lockstep_group  # the ranks that must make this session's calls too
        if self.lockstep_group is not None:  # they admit alike only on as many slots (free GPU memory may differ)
            slot_total = fewest(slot_total, self.lockstep_group)
        super().__init__(engine, params, matcher, slot_total, max_length, max_length, record_routing)
        self.weights = weights_fingerprint(engine.model)
        # Per turn waiting or generating (an index never reused): its ids, sampling stream, cap, episode,
        # and, once admitted, the positions of its ids its slot already holds.
        self.prompts: dict[int, list[int]] = {}
        self.seeds: dict[int, int] = {}
        self.max_new_tokens: dict[int, int] = {}
        self.episodes: dict[int, Hashable] = {}
        self.starts: dict[int, int] = {}
        self.waiting: deque[int] = deque()
        self.turn_of: dict[Hashable, int] = {}  # episode -> its turn waiting or generating
        self.slot_of: dict[Hashable, int] = {}  # episode -> the slot holding its K/V
        self.evicted: set[Hashable] = set()  # episodes whose slot another took
        # Per slot: the episode it belongs to (None: free), the tokens whose K/V it holds (None while a turn
        # generates in it) and the turn count when its last turn finished (the oldest is evicted first).
        self.episode_in: list[Hashable | None] = [None] * slot_total
        self.held: list[list[int] | None] = [None] * slot_total
        self.finished_at = np.zeros(slot_total, dtype=np.int64)
        self.counts = {"recomputed_tokens": 0, "evictions": 0, "moves": 0, "turns": 0}
        self.done: list[tuple[Hashable, GenerationOutput]] = []
        self.routing: list[torch.Tensor] = []  # with record_routing: the experts of each turn in `done`, on the device
        self.next_turn = 0
        with torch.inference_mode():
            self._allocate()

    @property
    def stats(self) -> dict:
        """Tokens prefilled (recomputed ones included), continued from a slot, prefilled again after an
        eviction or a turn that did not extend its slot; evictions, episodes moved to a lower slot, turns
        finished, decode steps."""
        return {"prefilled_tokens": self.prefilled_tokens, "reused_tokens": self.reused_tokens, **self.counts,
                "decode_steps": self.steps}

    def submit(self, key: Hashable, ids: list[int], max_new_tokens: int, seed: int) -> None:
        """Queue a turn of episode `key`: continue `ids` (its whole trajectory so far) by at most
        `max_new_tokens`, sampling from request_seed(seed, 0)."""
        self._check_open()
        if key in self.turn_of:
            raise ValueError(f"episode {key!r} already has a turn in progress; submit its next turn after step() "
                             "returns this one")
        if not ids or max_new_tokens < 1:
            raise ValueError(f"episode {key!r}: a turn needs at least one id and max_new_tokens >= 1, got "
                             f"{len(ids)} ids and {max_new_tokens}")
        if len(ids) + max_new_tokens > self.length:
            raise ValueError(f"episode {key!r}: {len(ids)} ids + max_new_tokens={max_new_tokens} exceed the turn "
                             f"session's max_length={self.length}; open it with a larger max_length or sample fewer")
        turn, self.next_turn = self.next_turn, self.next_turn + 1
        self.prompts[turn] = list(ids)
        self.seeds[turn] = request_seed(seed, 0)
        self.max_new_tokens[turn] = max_new_tokens
        self.episodes[turn], self.turn_of[key] = key, turn
        self.waiting.append(turn)

    def busy(self) -> bool:
        """Whether a turn waits or decodes."""
        return bool(self.waiting) or bool((self.occupant >= 0).any())

    def step(self) -> list[tuple[Hashable, GenerationOutput]]:
        """Admit the waiting turns that get a slot, launch one decode step, read the step launched
        LOOKAHEAD before it; the turns that finished, with their outputs."""
        self._check_open()
        with torch.inference_mode():
            if self.waiting:
                self._admit_waiting()
            rows, last = self._busy_shape()
            if rows:
                self._decode(rows, last)
            self._read_launched()
        done, self.done = self.done, []
        for (_, output), routing in zip(done, routing_on_host(self.routing)):
            output.routing = routing
        self.routing = []
        return done

    def release(self, key: Hashable) -> None:
        """Episode `key` ended: its slot is free. A turn of it still waiting or generating is dropped
        (never returned); an unknown or already released key is ignored."""
        turn = self.turn_of.pop(key, None)
        if turn is not None:
            self.waiting = deque(waiting for waiting in self.waiting if waiting != turn)
            generating = np.flatnonzero(self.occupant == turn)
            self.occupant[generating] = -1  # a step launched for it is read for nobody
            if len(generating):
                self._idle(generating)
            for per_turn in (self.prompts, self.seeds, self.max_new_tokens, self.episodes):
                del per_turn[turn]
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            self.episode_in[slot] = self.held[slot] = None
        self.evicted.discard(key)

    def close(self) -> None:
        """Free the cache and the decode step's graphs; the session takes no more turns."""
        self.slots = self.graphs = None
        self.in_flight.clear()

    def _check_open(self) -> None:
        if self.slots is None:
            raise RuntimeError("the turn session is closed; open another with engine.open_session")

    def _admit_waiting(self) -> None:
        """Give each waiting turn a slot, in submission order: its episode's own, else a free one, else
        one evicted; prefill those admitted together."""
        if weights_fingerprint(self.engine.model) != self.weights:
            raise RuntimeError("the policy's weights changed while a turn session was open (its K/V belong to the "
                               "old weights); close it and open another")
        taken = {self.slot_of[self.episodes[turn]] for turn in self.waiting if self.episodes[turn] in self.slot_of}
        admitted, moves = [], []
        for turn in self.waiting:
            key = self.episodes[turn]
            slot = self.slot_of.get(key)
            if slot is None:
                slot = self._vacant_slot(taken)
                if slot is None:
                    continue
            else:
                taken.discard(slot)
                slot = self._moved_down(key, slot, taken, moves)
            taken.add(slot)
            self.starts[turn] = self._held_prefix(key, turn, slot)
            admitted.append((turn, slot))
        if moves:  # one copy for all (it reads every source before it writes a target), before any prefill
            sources, targets, lengths = zip(*moves)
            self.slots.cache.copy_from(self.slots.cache, list(sources), list(targets), max(lengths))
        if admitted:
            started = {turn for turn, _ in admitted}
            self.waiting = deque(turn for turn in self.waiting if turn not in started)
            self._admit(admitted)
            self.starts.clear()

    def _moved_down(self, key: Hashable, slot: int, taken: set[int], moves: list[tuple[int, int, int]]) -> int:
        """The episode's slot, or the lowest free slot below it, its K/V to be copied there (`moves`:
        source, target, positions): the decode step runs over slots [0, highest busy slot], so episodes
        that outlive others move down into the slots those freed rather than keep the step as wide as
        the episodes that started with them."""
        free = next((lower for lower in range(slot) if lower not in taken and self.episode_in[lower] is None
                     and self.occupant[lower] < 0), None)
        if free is None:
            return slot
        held = self.held[slot]
        if held:
            moves.append((slot, free, len(held)))
        self.episode_in[free], self.held[free], self.finished_at[free] = key, held, self.finished_at[slot]
        self.episode_in[slot] = self.held[slot] = None
        self.slot_of[key] = free
        self.counts["moves"] += 1
        return free

    def _vacant_slot(self, taken: set[int]) -> int | None:
        """The lowest slot of no episode, else the slot evicted from the episode not generating whose
        last turn finished longest ago; None while every slot not `taken` generates."""
        idle = [slot for slot in range(self.slot_total) if slot not in taken and self.occupant[slot] < 0]
        free = [slot for slot in idle if self.episode_in[slot] is None]
        if free:
            return free[0]
        if not idle:
            return None
        slot = min(idle, key=lambda slot: self.finished_at[slot])
        owner = self.episode_in[slot]
        del self.slot_of[owner]
        self.evicted.add(owner)
        self.episode_in[slot] = self.held[slot] = None
        self.counts["evictions"] += 1
        return slot

    def _held_prefix(self, key: Hashable, turn: int, slot: int) -> int:
        """Take `slot` for the turn; the positions of its ids the slot holds: all it holds when the ids
        extend them, else none (the turn's ids count as recomputed when the episode had a slot)."""
        held, ids = self.held[slot], self.prompts[turn]
        self.episode_in[slot], self.held[slot], self.slot_of[key] = key, None, slot
        if held is not None and len(held) < len(ids) and ids[: len(held)] == held:
            return len(held)
        if held is not None or key in self.evicted:
            self.evicted.discard(key)
            self.counts["recomputed_tokens"] += len(ids)
        return 0

    def _prefix_starts(self, runs: list[tuple[int, int]]) -> list[int]:
        return [self.starts[turn] for turn, _ in runs]

    def _finish(self, turn: int, slot: int, finish_reason: str) -> None:
        if self.record_routing:
            self.routing.append(self._routing_of(slot, len(self.prompts[turn]) + int(self.generated[slot]) - 1))
        key = self.episodes.pop(turn)
        self.held[slot] = self.prompts.pop(turn) + self.tokens[slot, : self.generated[slot] - 1].tolist()
        del self.seeds[turn], self.max_new_tokens[turn], self.turn_of[key]
        self.finished_at[slot] = self.counts["turns"]
        self.counts["turns"] += 1
        self.done.append((key, self._output(slot, finish_reason)))
