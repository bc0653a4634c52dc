"""What the routers of a mixture of experts do in the Megatron backend's forwards, as on the HF backend
(`models/moe.py`, docs/models.md "Mixtures of experts"): the expert load and router entropy of the
training forwards, the load-balancing loss, the mismatch with the rollout engine's experts, and
routing replay.

`Routers` wraps each megatron-core router's `gating` (the router logits [s, b, experts] of its layer,
`router.layer_number - 1` its global index under PP) for one GPTModel (the policy's; the KL
reference's has its own). While a micro-batch's forward runs (`begin` / `end`, called by forward.py
around the stage's forward), its tokens are those of this rank in the routers' order ([s, b]
flattened, this TP rank's sequence shard under sequence parallelism), and, within a `forwards` block:
- `tally`: the router logits are added into the HF backend's `RouterTally` over the real tokens
  (`Packed.real`; pads and filler rows excluded);
- `compare`: each layer's own top k is compared with the engine's (`Packed.routing`) into the HF
  backend's `RoutingMismatch`; the tokens differing in some layer are pooled over the pipeline
  stages (each holds its layers) when the metrics are taken;
- with `policy.routing_replay`, megatron-core's own replay (`RouterReplay`, REPLAY_FORWARD) takes the
  engine's experts (the router's own where the engine recorded none). Its weights agree with the HF
  backend's: Qwen2-MoE (softmax before the top k, `moe_router_pre_softmax`) gathers the float32
  softmax over all experts at them; Qwen3-MoE (top k of the logits, then a softmax over those k)
  takes the softmax of the gathered logits, which is the gathered softmax renormalised.
- with `policy.router_aux_loss_coef` > 0, megatron-core's load-balancing loss (model.moe_options)
  over the real tokens (`padding_mask`) of each micro-batch and layer is attached to the router's
  probabilities weighted by the micro-batch's share of the update's real tokens (`_attach`), so the
  update adds coef x sum over micro-batches of share x (the per-layer losses summed over layers),
  as the HF backend averages its loss over the mini-batch; megatron-core's own scaling (by the
  rank's local token count, for a schedule that divides by the tokens afterwards) does not apply
  here, where the policy loss arrives already divided by the update's global counts.
Under activation recomputation a layer runs again in the backward, outside any micro-batch's
forward: each router keeps the micro-batches of its recomputed forwards in order (the schedules run
the backwards in the order of the forwards) so the recomputation replays the same experts and
weights the loss alike; nothing is counted twice. `take` and `take_mismatch` sum over every rank (DP
ranks hold other rows, TP ranks other sequence shards, PP stages other layers), so every rank
returns the same metrics. The RouterReplay objects are kept out of megatron-core's class-wide list,
whose static methods would drive the policy's and the reference's routers together.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from aligner_ext.generation.base import NOT_RECORDED
from aligner_ext.models.moe import RouterTally, RoutingMismatch


@dataclass
class MicroBatch:
    """One micro-batch's forward as this rank's routers see it."""

    real: torch.Tensor  # [tokens] bool
    engine: torch.Tensor | None  # [tokens, layers, k] int16, the engine's experts (NOT_RECORDED: none)
    share: float  # of the update's real tokens: the load-balancing loss's weight
    differs: torch.Tensor  # [tokens] bool: some layer of this stage chose other experts than the engine
    recorded: torch.Tensor | None = field(init=False)  # [tokens] bool: the engine recorded its experts

    def __post_init__(self):
        self.recorded = self.engine[:, 0, 0] != NOT_RECORDED if self.engine is not None else None


def local_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """[b, S, ...] -> this rank's [S_local, b, ...] in the routers' order (its shard under sequence parallelism)."""
    tokens = tokens.transpose(0, 1)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:  # a mixture of experts under TP runs sequence parallel (model.transformer_config)
        shard = tokens.shape[0] // tp
        start = parallel_state.get_tensor_model_parallel_rank() * shard
        tokens = tokens[start:start + shard]
    return tokens


class Routers:
    """The routers of one GPTModel (module docstring)."""

    def __init__(self, core: torch.nn.Module, num_layers: int, experts: int, top_k: int, replay: bool):
        device = next(core.parameters()).device
        self.tally = RouterTally(num_layers, experts, top_k, device)
        self.mismatch = RoutingMismatch(num_layers, device)
        self.aux = torch.zeros((), dtype=torch.float64, device=device)  # sum of share x per-layer losses (no coef)
        self.top_k, self.replay = top_k, replay
        self.current: MicroBatch | None = None  # during a micro-batch's forward
        self.compared: list[tuple[torch.Tensor, torch.Tensor]] = []  # (differs, recorded) of the forwards compared
        self.tallying = self.comparing = False
        self.real_tokens = 0  # of the update (all DP ranks): the denominator of the shares
        self.routers = [module for module in core.modules() if isinstance(module, TopKRouter)]
        self.aux_coef = self.routers[0].get_aux_loss_coeff("aux_loss") if self.routers else 0.0
        for router in self.routers:
            _Hook(self, router)

    @contextmanager
    def forwards(self, tally: bool = False, compare: bool = False, real_tokens: int = 0) -> Iterator[None]:
        """What the micro-batches' forwards inside record: the expert load and entropy (`tally`, the
        training forwards) and the mismatch (`compare`, the step's first forward); `real_tokens`: the
        update's, over every DP rank (for the load-balancing loss)."""
        self.tallying, self.comparing, self.real_tokens = tally, compare, real_tokens
        try:
            yield
        finally:
            self.tallying = self.comparing = False

    def begin(self, real: torch.Tensor, routing: torch.Tensor | None, real_tokens: int) -> torch.Tensor | None:
        """A micro-batch's forward starts: `real` [b, S] marks its `real_tokens` real tokens and
        `routing` [b, S, layers, k] the engine's experts (or None), over the whole sequence as every
        rank of a TP group holds it. Returns megatron-core's padding mask [b, S_local] (True on pads)
        where the load-balancing loss needs it, else None."""
        tokens = local_tokens(real)
        engine = local_tokens(routing).flatten(0, 1) if routing is not None else None
        share = real_tokens / self.real_tokens if self.real_tokens else 0.0
        flat = tokens.reshape(-1)
        self.current = MicroBatch(flat, engine, share, torch.zeros_like(flat))
        return ~tokens.transpose(0, 1) if self.aux_coef > 0 else None

    def end(self) -> None:
        if self.comparing and self.current.engine is not None:
            self.compared.append((self.current.differs, self.current.recorded))
        self.current = None

    def take(self) -> dict[str, float]:
        """The expert loads and router entropies (and the load-balancing loss) recorded since the last
        call, the same on every rank; then reset."""
        totals = torch.cat([self.tally.totals(), self.aux.view(1)])
        dist.all_reduce(totals)
        metrics = self.tally.metrics(totals[:-1])
        if self.aux_coef > 0:
            metrics["loss/router_aux"] = float(totals[-1])
        self.aux.zero_()
        return metrics

    def take_mismatch(self) -> dict[str, float]:
        """The routing mismatch since the last call (none without engine routing), the same on every
        rank; then reset. A token differs where it does in a layer of any pipeline stage."""
        mismatch = self.mismatch
        if self.compared:
            differs = torch.cat([differs for differs, _ in self.compared]).to(torch.int32)
            if parallel_state.get_pipeline_model_parallel_world_size() > 1:
                dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=parallel_state.get_pipeline_model_parallel_group())
            if parallel_state.is_pipeline_first_stage():  # every stage holds the same tokens: counted once
                mismatch.add_tokens(differs.bool(), torch.cat([recorded for _, recorded in self.compared]))
        self.compared = []
        totals = torch.cat([mismatch.differing, mismatch.compared, mismatch.differing_tokens.view(1),
                            mismatch.tokens.view(1)])
        dist.all_reduce(totals)
        layers = len(mismatch.differing)
        mismatch.differing.copy_(totals[:layers])
        mismatch.compared.copy_(totals[layers:2 * layers])
        mismatch.differing_tokens.copy_(totals[-2])
        mismatch.tokens.copy_(totals[-1])
        return mismatch.metrics()


class _Hook:
    """One router's part of `Routers`: its `gating` wrapped, its replay and its load-balancing loss."""

    def __init__(self, routers: Routers, router: TopKRouter):
        self.routers, self.router = routers, router
        self.layer = router.layer_number - 1
        self.gating = router.gating
        self.recomputed: deque[MicroBatch] = deque()  # forwards whose layer the backward runs again
        self.active: MicroBatch | None = None  # the micro-batch of the router's call under way
        self.recomputes = router.config.recompute_granularity == "full"
        router.gating = self
        if routers.aux_coef > 0:
            router.attach_and_log_load_balancing_loss = self._attach
        if routers.replay:
            router.router_replay = RouterReplay()
            RouterReplay.global_router_replay_instances.remove(router.router_replay)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.gating(hidden)
        routers, forward = self.routers, self.routers.current
        flat = logits.reshape(-1, logits.shape[-1])
        compare = routers.comparing and forward is not None
        if forward is None:  # a recomputation in the backward
            forward = self.recomputed.popleft() if self.recomputed else None
        else:
            if self.recomputes and self.router.training:
                self.recomputed.append(forward)
            if routers.tallying:
                routers.tally.add(self.layer, flat, forward.real)
        self.active = forward
        if routers.replay:
            self.router.router_replay.clear_router_replay_action()
        if forward is None or forward.engine is None or not (compare or routers.replay):
            return logits
        engine, own = forward.engine[:, self.layer].long(), self._own(flat)
        if compare:
            forward.differs |= routers.mismatch.add(self.layer, own, engine, forward.recorded)
        if routers.replay:  # where the engine recorded none, the router's own
            self.router.router_replay.target_topk_idx = torch.where(forward.recorded[:, None], engine, own)
            self.router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        return logits

    def _own(self, logits: torch.Tensor) -> torch.Tensor:
        """The router's own top k [tokens, k], chosen as megatron-core chooses it."""
        with torch.no_grad():
            if self.router.config.moe_router_pre_softmax:
                logits = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            return logits.topk(self.routers.top_k, dim=-1).indices

    def _attach(self, activation: torch.Tensor, coefficient: float, aux_loss: torch.Tensor, *args, **kwargs
                ) -> torch.Tensor:
        """megatron-core's `attach_and_log_load_balancing_loss` for this backend: the layer's loss
        (`aux_loss`, coefficient included, this rank's part of it under sequence parallelism) weighted
        by the micro-batch's share of the update's real tokens; nothing for a micro-batch of pads."""
        share = self.active.share if self.active is not None else 0.0
        if share == 0:
            return activation
        self.routers.aux += aux_loss.detach().double() / coefficient * share
        return MoEAuxLossAutoScaler.apply(activation, aux_loss * share)
