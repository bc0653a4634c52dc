"""Agent episodes under several processes (torchrun): which process plays which episodes, and how the
processes that hold one model's shards play theirs together.

- Data parallel. The episodes of a call (n per prompt draw, in (draw, copy) order) are split as a
  generate call's prompts are (generation/sharded.py): rank r of the engine's split group plays its
  contiguous `distributed.share` of them, and the outcomes and the sessions' counts are all-gathered
  (`distributed.map_split`), so every rank assembles the same batch and metrics and the loop stays
  replicated. Episode i of a call is seeded request_seed(seed, i), by its place in the call and not
  by the rank that plays it, so W processes play the episodes one process plays (a generate call's
  split reseeds each rank's share instead: `rank_seed`).
- Lockstep. A turn session on a model split across processes (tensor parallelism: the ranks of a
  session's `lockstep_group` decode the same turns together, with collectives inside each step) needs
  every rank of the group to make the same session calls in the same order, but the episode loop's
  calls follow the environments' answers, which come in their own time on each process. So the
  group's first rank plays the episodes and runs the environments (`LeadingSession`: each submit,
  release, step and close is broadcast to the group before it runs), the others repeat the calls
  (`follow`) and then receive the first rank's result, so every rank of the group returns the same
  outcomes. A call that raises on the first rank raises on the others too, naming it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from aligner_ext.distributed import map_split

Result = TypeVar("Result")


def split_play(play: Callable[[list], tuple[list, Counter]], episodes: list, group) -> tuple[list, Counter]:
    """`play` over this rank's share of `episodes` in `group` (None: every rank): every rank returns
    the outcomes of all of them, in order, and the counts of every rank's session summed. Collective."""
    counts = Counter()

    def mine(share: list) -> list:
        outcomes, session_counts = play(share)
        counts.update(session_counts)
        return outcomes

    outcomes = map_split(mine, episodes, group)
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, counts, group=group)
    total = Counter()
    for rank_counts in every:
        total.update(rank_counts)  # update, not +: a count of 0 stays a key (episode_metrics reads which exist)
    return outcomes, total


def in_lockstep(session: Any, play: Callable[[Any], Result]) -> Result:
    """`play(session)` on the first rank of the session's `lockstep_group`, its session calls repeated
    on the other ranks; every rank returns its result (module docstring). Without a group, `play(session)`."""
    group = getattr(session, "lockstep_group", None)
    if group is None:
        return play(session)
    source = dist.get_global_rank(group, 0)
    if dist.get_rank(group) > 0:
        failure = follow(session, group, source)
        status, value = _broadcast(None, group, source)
        if status == "error":
            raise RuntimeError(f"the episodes failed on rank {source}, which plays them for this rank ({value})")
        if failure is not None:
            raise failure
        return value
    try:
        result = play(LeadingSession(session, group, source))
    except Exception as err:
        _broadcast(("error", f"{type(err).__name__}: {err}"), group, source)
        raise
    _broadcast(("ok", result), group, source)
    return result


class LeadingSession:
    """A turn session whose state-changing calls the other ranks of its lockstep group repeat (`follow`):
    each is broadcast before it runs here. Episodes are known to the others by numbers."""

    def __init__(self, session: Any, group, source: int):
        self.session, self.group, self.source = session, group, source
        self.numbers: dict[Hashable, int] = {}
        self.keys: dict[int, Hashable] = {}

    @property
    def stats(self) -> dict:
        return self.session.stats

    def submit(self, key: Hashable, ids: list[int], max_new_tokens: int, seed: int) -> None:
        number = self.numbers.setdefault(key, len(self.numbers))
        self.keys[number] = key
        self._run("submit", number, list(ids), max_new_tokens, seed)

    def busy(self) -> bool:
        return self.session.busy()

    def step(self) -> list:
        return [(self.keys[number], output) for number, output in self._run("step")]

    def release(self, key: Hashable) -> None:
        if key in self.numbers:  # an episode that never submitted a turn holds nothing
            self._run("release", self.numbers[key])

    def close(self) -> None:
        self._run("close")

    def _run(self, name: str, *args):
        _broadcast((name, args), self.group, self.source)
        return getattr(self.session, name)(*args)


def follow(session: Any, group, source: int) -> Exception | None:
    """Repeat the calls `source`'s LeadingSession broadcasts on this rank's `session` until it closes.
    A call that raises here stops the repeating (the group's first rank, in the same state, raised
    too) but not the listening, so the group meets at the close; the error is returned."""
    failure = None
    while True:
        name, args = _broadcast(None, group, source)
        if failure is None or name == "close":
            try:
                getattr(session, name)(*args)
            except Exception as err:  # noqa: BLE001 - raised by the caller once the group has met
                failure = failure or err
        if name == "close":
            return failure


def _broadcast(value: Any, group, source: int) -> Any:
    """`source`'s value on every rank of `group` (gloo: host objects)."""
    box = [value]
    dist.broadcast_object_list(box, src=source, group=group)
    return box[0]
