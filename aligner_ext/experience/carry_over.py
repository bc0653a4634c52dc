"""Group-level streaming (`rollout.carry_over`): each step's engine call runs the batch's groups and `groups`
more, and ends once a batch of groups is whole; the unfinished groups go on in the next step's call, their
tokens kept with the log-probs and versions that sampled them (docs/async.md, "Group-level streaming").

Why: a call that waits for its slowest response leaves the engine decoding a few rows of the long tail
while its other rows sit empty. With groups carried over, the extra groups fill those rows, the step ends
once B groups (B = data.train_batch_size) are done, and the long responses finish in a later call.

B is the prompt loader's batch at each call: data.train_batch_size, or under dynamic sampling the groups a
refill asks for (experience/dynamic_sampling.py), whose calls carry groups to each other as steps do.

Per step (`CarryOver.generate`):
- The call's groups: the carried ones, oldest first, then new prompt draws, B + `groups` in all. A carried
  response resumes as a request of its generator prompt followed by its tokens so far, prefilled whole under
  the current weights (no key or value of older weights serves it), for the tokens it has left
  (generation/resumable.py's `continue_with`, which also matches a stop string straddling the resumption).
  Its later tokens carry the current version: a response's versions may vary, as a parked one's do.
- The call (the rollout engine, whose batch refills as responses finish) reports each whole response
  (`on_finished`) and stops once B groups are whole and no overdue group is still running (overdue=wait).
- The batch: B whole groups, the most carried first (so an overdue one is always taken), then in draw order.
  Whole groups beyond B wait in the carry and lead the next batch; unfinished groups are carried once more.
  A group carried out of `max_steps` calls is overdue: the call waits for it, or (overdue=drop) it is dropped
  at the call's end and counted. `groups` <= data.train_batch_size (checked at load), so the overdue groups fit
  one step's batch; a refill smaller than them takes the most carried first, and the others lead the next call.
- The carry is the maker's state: a checkpoint holds it, and a resume goes on with it.

Staleness: a token trained at step t was sampled at most `max_steps` calls, so at most `max_steps` steps,
before t's last call: at most `max_steps` steps' updates older than the weights that call started on (plus
generation ahead's k).
Metrics: carry_over/carried_groups (waiting for the next call), carry_over/batch_share_carried (the share of
the batch's groups drawn at an earlier call: an earlier step, or under dynamic sampling an earlier refill),
carry_over/dropped_groups.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Callable

from aligner_ext.data.loader import PromptLoader
from aligner_ext.data.types import PromptDraw
from aligner_ext.experience.settings import CarryOverConfig
from aligner_ext.generation.base import GenerationEngine, GenerationOutput, SamplingParams
from aligner_ext.generation.resumable import Partial, continue_with
from aligner_ext.generation.stopping import StopStringMatcher


@dataclass(eq=False)  # a group is itself: the carry finds it by identity
class Group:
    """One prompt draw's samples, as far as they got: its requests, and a response per request."""

    requests: list  # [SampleRequest] x n
    responses: list[Partial] = field(default_factory=list)
    carried: int = 0  # calls it was carried out of

    @property
    def whole(self) -> bool:
        return all(response.finish_reason is not None for response in self.responses)


class CarryOver:
    """The groups carried between steps, and the call that goes on with them (module docstring)."""

    def __init__(self, cfg: CarryOverConfig, engine: GenerationEngine, tokenizer):
        self.cfg, self.engine = cfg, engine
        self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        self.groups: list[Group] = []  # carried, in the order the next batch takes whole ones

    def generate(self, loader: PromptLoader, params: SamplingParams,
                 requests_of: Callable[[list[PromptDraw]], list]) -> tuple[list, list[GenerationOutput], dict]:
        """Step's (requests, outputs) for B whole groups (B = `loader.batch_size`), and the carry's metrics."""
        batch_groups = loader.batch_size
        draws = loader.next_batch(max(0, batch_groups + self.cfg.groups - len(self.groups)))
        by_draw = itertools.groupby(requests_of(draws), key=lambda request: request.group_id)
        fresh = [Group(requests, [Partial() for _ in requests]) for requests in (list(group) for _, group in by_draw)]
        groups = self.groups + fresh
        self._run(groups, params, batch_groups)
        taken = [group for group in groups if group.whole][:batch_groups]  # the most carried first
        overdue = [group for group in groups if not group.whole and group.carried >= self.cfg.max_steps]
        self.groups = [group for group in groups if group not in taken and group not in overdue]
        for group in self.groups:
            group.carried += 1
        self.groups.sort(key=lambda group: -group.carried)
        requests = [request for group in taken for request in group.requests]
        outputs = [response.output(params.return_logprobs) for group in taken for response in group.responses]
        metrics = {"carry_over/carried_groups": len(self.groups), "carry_over/dropped_groups": len(overdue),
                   "carry_over/batch_share_carried": sum(group.carried > 0 for group in taken) / len(taken)}
        return requests, outputs, metrics

    def _run(self, groups: list[Group], params: SamplingParams, batch_groups: int) -> None:
        """One engine call over every unfinished response of `groups`, until `batch_groups` groups are whole and
        (waiting for overdue groups) none of those is running."""
        running = [(group, index) for group in groups for index, response in enumerate(group.responses)
                   if response.finish_reason is None]
        if not running:
            return
        left = {id(group): sum(response.finish_reason is None for response in group.responses) for group in groups}
        whole = sum(not count for count in left.values())
        overdue = {id(group) for group in groups if group.carried >= self.cfg.max_steps and left[id(group)]}

        def on_finished(index: int) -> None:
            nonlocal whole
            key = id(running[index][0])
            left[key] -= 1
            if not left[key]:
                whole += 1
                overdue.discard(key)

        def enough() -> bool:
            return whole >= batch_groups and (self.cfg.overdue == "drop" or not overdue)

        version = self.engine.weights_version
        prompts = [group.requests[index].generation_prompt + group.responses[index].token_ids
                   for group, index in running]
        caps = [params.max_new_tokens - len(group.responses[index].token_ids) for group, index in running]
        outputs = self.engine.generate(prompts, params, should_stop=enough, caps=caps, on_finished=on_finished)
        continue_with([group.responses[index] for group, index in running], outputs, params.max_new_tokens, version,
                      StopStringMatcher(params.stop, self.decode))

    def state_dict(self) -> dict:
        return {"carried": copy.deepcopy(self.groups)}  # the next call extends the live ones

    def load_state_dict(self, state: dict) -> None:
        self.groups = list(state["carried"])
